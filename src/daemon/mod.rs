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
use std::path::{Path, PathBuf};
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
use crate::projection::{ProjectionCache, Projector};
use crate::scheduler::actor::Scheduler;
use crate::scheduler::backend::Projections;
use crate::scheduler::backend::SupervisorBackend;
use crate::scheduler::footprints::Footprints;
use crate::scheduler::handle::Handle;
use crate::scheduler::keep_alive::{Clamp, KeepAlive};
use crate::scheduler::policy::GpuView;
use crate::scheduler::projections::CachedProjections;
use crate::scheduler::request;
use crate::scheduler::types::{Limits, Stats};
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
    /// The layer under the files (`corrald --user`), applied again on reload.
    pub base: toml::Table,
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
    let Daemon { source, base, loaded, paths, sockets, notifier, watchdog, log_target } = daemon;
    let mut loaded = loaded;
    // Handlers first: a signal that arrives during start-up must not kill the process.
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sighup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;

    log_start(&loaded, &paths);

    raise_open_files_limit();
    // Taking the cgroup tree moves the daemon into its leaf; runners become its siblings.
    let cgroups = take_cgroup_tree();
    // After the move: the probe's child must not land in the service's own cgroup.
    check_llama_server(&loaded.config.runner.llama_server);
    crate::projection::log_availability(&loaded.config.runner, std::env::var_os("PATH").as_deref());
    let store = open_store(&loaded.config, &paths).await?;
    start_gc(&loaded.config, &store);
    // Listen before any runner starts: a start that fails to listen leaves nothing behind.
    let socket_activated = !sockets.is_empty();
    let listeners = listen(sockets, &loaded.config).await?;
    let (scheduler, inventory, scheduler_task) = start_scheduler(&loaded.config, &paths, cgroups, log_target).await?;
    let gpu_count = inventory.gpus.len();
    preload(&loaded.config, &store, &scheduler);
    let names: Vec<String> = listeners.iter().map(listeners::Listener::describe).collect();
    let status_of = |models: usize| {
        format!("serving on {}; {} loaded", names.join(", "), crate::units::count(models, "model", "models"))
    };
    let mut models = 0;
    let mut status = status_of(models);

    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    let requests = Requests::default();
    let state = app_state(&loaded.config, store.clone(), scheduler.clone(), Arc::new(inventory));
    // Served before READY=1, so that a client started after the service finds the name.
    let mut bus = serve_dbus(&loaded.config, &state).await;
    let router = http::router(state).layer(from_fn_with_state(requests.clone(), count_requests));
    for listener in listeners {
        servers.spawn(listener.serve(router.clone(), loaded.config.server.header_timeout, shutdown.clone()));
    }
    // The sockets are listening and their accept loops are spawned: connections are served.
    notifier.ready(&status);
    tracing::info!(corral_event = "ready", listeners = ?names, socket_activated, "corrald ready: {status}");

    let mut watchdog_tick = watchdog.map(|interval| tokio::time::interval(interval / 2));
    let mut vital = Vital { scheduler: scheduler_task };
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
                if reload(&source, &base, &mut loaded, socket_activated, &notifier) {
                    scheduler.reconfigure(limits(&loaded.config, gpu_count)).await;
                }
                notifier.ready(&status);
            }
            // Pinged only once the scheduler answered, within a quarter of the interval
            // (ticks come every half): a hung scheduler gets the daemon restarted.
            () = tick(watchdog_tick.as_mut()) => {
                let within = watchdog.unwrap_or_default() / 4;
                watchdog_ping(&notifier, &scheduler, within).await;
            }
            // A dead background task leaves the daemon answering with errors only: exit,
            // non-zero, so that systemd restarts it.
            death = vital.died(follower(bus.as_mut())) => break Some(death),
            // STATUS= follows the loaded models; the same tick watches for idleness.
            _ = status_tick.tick() => {
                // A scheduler that does not answer counts as busy (and gets no watchdog ping).
                let snapshot = tokio::time::timeout(Duration::from_secs(1), scheduler.stats()).await.ok().and_then(Result::ok);
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
        tracing::warn!(
            timeout = ?grace,
            "open connections did not finish within {}; dropping them",
            crate::durations::human(grace)
        );
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

/// The sockets systemd passed, or else the configured `[server] listen` addresses bound.
async fn listen(
    sockets: Vec<(String, OwnedFd)>,
    config: &Config,
) -> Result<Vec<listeners::Listener>, listeners::ListenError> {
    if sockets.is_empty() { listeners::bind(&config.server.listen).await } else { listeners::adopt(sockets) }
}

/// The journal's first entry: version, configuration files and directories.
fn log_start(loaded: &Loaded, paths: &Paths) {
    tracing::info!(
        corral_event = "start",
        version = http::VERSION,
        config_files = ?loaded.files,
        state_directory = %paths.state.display(),
        runtime_directory = %paths.runtime.display(),
        "corrald {} starting",
        http::VERSION,
    );
}

/// Why the configured llama-server cannot run.  Each message names the key, so that the
/// reader knows what to change.
#[derive(Debug, thiserror::Error)]
pub enum LlamaServerProblem {
    /// A bare name that no directory on `PATH` holds as an executable.
    #[error(
        "[runner] llama_server: \"{name}\" is not found on PATH ({path}); models cannot load until it is \
         installed there or [runner] llama_server names the executable"
    )]
    NotOnPath {
        /// The configured name.
        name: String,
        /// The `PATH` searched.
        path: String,
    },
    /// A path that names nothing, or something that is not an executable file.
    #[error("[runner] llama_server: {} {why}; models cannot load until it names the llama-server executable", .path.display())]
    Unusable {
        /// The configured path.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// Where `llama_server` (a path, or a bare name looked up on `PATH`) resolves to, or why it
/// cannot run.  A handful of lines, so no crate: the child's `PATH` is the daemon's.
pub fn find_llama_server(llama_server: &Path) -> Result<PathBuf, LlamaServerProblem> {
    if llama_server.components().count() > 1 || llama_server.is_absolute() {
        return executable(llama_server)
            .map(|()| llama_server.to_owned())
            .map_err(|why| LlamaServerProblem::Unusable { path: llama_server.to_owned(), why });
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(llama_server))
        .find(|candidate| executable(candidate).is_ok())
        .ok_or_else(|| LlamaServerProblem::NotOnPath {
            name: llama_server.display().to_string(),
            path: path.to_string_lossy().into_owned(),
        })
}

/// Ok when `path` is a file this process may execute, else why not.
fn executable(path: &Path) -> Result<(), String> {
    let metadata = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        _ => format!("cannot be read: {e}"),
    })?;
    if !metadata.is_file() {
        return Err("is not a file".to_owned());
    }
    nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).map_err(|e| format!("is not executable: {}", e.desc()))
}

/// Checks `[runner] llama_server` at start: a warning now, naming the key and the path,
/// instead of an error at the first chat.  The daemon starts either way (the store can
/// still be used, and llama-server may be installed later).
fn check_llama_server(llama_server: &Path) {
    match find_llama_server(llama_server) {
        Ok(found) => {
            tracing::debug!(llama_server = %found.display(), "llama-server is {}", found.display());
            // A wrong program (another tool, a broken build) is found by asking it, in the
            // background: readiness does not wait for it.
            tokio::spawn(probe_llama_server(found));
        }
        Err(e) => tracing::warn!(error = %e, "{e}"),
    }
}

/// Runs `llama-server --version` and warns, naming the key and the path, unless it
/// answers as llama.cpp's builds do (`version: ...`).
async fn probe_llama_server(path: PathBuf) {
    const WITHIN: Duration = Duration::from_secs(10);
    let run = tokio::process::Command::new(&path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let problem = match tokio::time::timeout(WITHIN, run).await {
        Ok(Ok(out)) => {
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            if out.status.success() && text.lines().any(|l| l.starts_with("version: ")) {
                let version = text.lines().find(|l| l.starts_with("version: ")).unwrap_or_default();
                tracing::debug!(llama_server = %path.display(), "llama-server's {version}");
                return;
            }
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("nothing").trim().to_owned();
            format!("`--version` exited with {} and printed \"{first}\"", out.status)
        }
        Ok(Err(e)) => format!("it cannot be run: {e}"),
        Err(_) => format!("`--version` did not answer within {}", crate::durations::human(WITHIN)),
    };
    tracing::warn!(
        llama_server = %path.display(),
        "[runner] llama_server: {} does not look like llama.cpp's llama-server ({problem}); loads will fail \
         until it names the llama-server executable",
        path.display()
    );
}

/// With a rejected configuration: answers the connections systemd passed (the ones that
/// started this instance, and those that come while it lingers) with 503 and where to look,
/// until none came for a few seconds.  Without this, each waiting connection would start
/// corrald again, and five failed starts in ten seconds stop corrald.socket.
pub async fn refuse(sockets: Vec<(String, OwnedFd)>) {
    /// The quiet time before exiting: longer than the start limit's 10 s / 5 starts, so a
    /// steady client can never drive corrald.socket into its start limit.
    const QUIET: Duration = Duration::from_secs(3);
    /// The longest stay, well within systemd's start timeout.
    const LINGER: Duration = Duration::from_secs(30);
    if sockets.is_empty() {
        return;
    }
    let listeners = match listeners::adopt(sockets) {
        Ok(listeners) => listeners,
        Err(e) => {
            tracing::warn!(error = %e, "cannot answer the waiting connections: {e}");
            return;
        }
    };
    // The reason stays in the journal: a rejected value may be a secret (a token written
    // where a list belongs), and this answer goes to anyone who can reach the socket,
    // before any Host rule or token applies.
    let message = "corrald is not running: its configuration is rejected; an administrator can see why with \
                   `journalctl -u corrald` or `corrald --check-config`";
    let body = Arc::new(serde_json::json!({ "error": message }).to_string());
    let answered = Arc::new(AtomicU64::new(0));
    let router = axum::Router::new().fallback({
        let (body, answered) = (body.clone(), answered.clone());
        move || {
            answered.fetch_add(1, Ordering::Relaxed);
            let body = (*body).clone();
            async move {
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    [(axum::http::header::CONTENT_TYPE, "application/json; charset=utf-8")],
                    body,
                )
            }
        }
    });
    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    for listener in listeners {
        servers.spawn(listener.serve(router.clone(), Duration::from_secs(5), shutdown.clone()));
    }
    let started = Instant::now();
    loop {
        let before = answered.load(Ordering::Relaxed);
        tokio::time::sleep(QUIET).await;
        if answered.load(Ordering::Relaxed) == before || started.elapsed() >= LINGER {
            break;
        }
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), async { while servers.join_next().await.is_some() {} }).await;
    tracing::info!(
        answered = answered.load(Ordering::Relaxed),
        "answered {} waiting requests with the configuration error",
        answered.load(Ordering::Relaxed)
    );
}

/// Unused blobs and stale partial downloads go at start, then every `[store] gc_interval`.
fn start_gc(config: &Config, store: &Store) {
    if let (false, Some(interval)) = (config.store.read_only, config.store.gc_interval) {
        tokio::spawn(crate::store::gc::run(store.clone(), Some(interval), config.store.gc_grace));
    }
}

/// Raises the soft limit on open files to the hard one: every connection, upload and
/// runner socket is a file, and the soft limit is often 1024 (systemd's default, kept
/// low for programs that still use `select`; corrald uses epoll).
fn raise_open_files_limit() {
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

/// The background tasks the daemon cannot serve without: the scheduler (and the D-Bus
/// follower, held by the bus service).
#[derive(Debug)]
struct Vital {
    scheduler: tokio::task::JoinHandle<()>,
}

impl Vital {
    /// Resolves once the scheduler or the D-Bus follower ended (they run until the daemon
    /// stops them, after this loop); logs which one and why, at error level, and returns
    /// it as the daemon's failure.
    async fn died(&mut self, follower: impl Future<Output = Result<(), tokio::task::JoinError>>) -> anyhow::Error {
        let (task, result) = tokio::select! {
            result = &mut self.scheduler => ("scheduler", result),
            result = follower => ("D-Bus follower", result),
        };
        task_died(task, result)
    }
}

/// The D-Bus follower's end, or never without D-Bus.
async fn follower(bus: Option<&mut dbus::Service>) -> Result<(), tokio::task::JoinError> {
    match bus {
        Some(bus) => bus.follower().await,
        None => std::future::pending().await,
    }
}

/// Why a vital task ended, logged; the error the daemon exits with.
fn task_died(task: &str, result: Result<(), tokio::task::JoinError>) -> anyhow::Error {
    let why = match result {
        Ok(()) => "ended unexpectedly".to_owned(),
        Err(e) if e.is_panic() => {
            let payload = e.into_panic();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            format!("panicked: {message}")
        }
        Err(e) => format!("was cancelled: {e}"),
    };
    tracing::error!(
        corral_event = "task_died",
        task,
        "the {task} task {why}; exiting so that systemd restarts corrald"
    );
    anyhow::anyhow!("the {task} task {why}")
}

/// Sends `WATCHDOG=1` only if the scheduler answers a round trip within `within`.
async fn watchdog_ping(notifier: &Notifier, scheduler: &Handle, within: Duration) -> bool {
    match tokio::time::timeout(within, scheduler.ping()).await {
        Ok(Ok(())) => {
            notifier.watchdog();
            true
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "the scheduler is gone; no watchdog ping");
            false
        }
        Err(_) => {
            tracing::error!(
                timeout = ?within,
                "the scheduler did not answer within {}; no watchdog ping",
                crate::durations::human(within)
            );
            false
        }
    }
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
    let due = clock.observe(activity, limit, Instant::now());
    // Each check is observable (at debug level), so that a test can wait for checks to
    // have run instead of sleeping to prove the daemon did not exit.
    tracing::debug!(
        corral_event = "idle_check",
        runners = activity.runners,
        queued = activity.queued,
        in_flight = activity.in_flight,
        due,
        "idle check"
    );
    if !due {
        return false;
    }
    let limit = limit.unwrap_or_default();
    tracing::info!(
        corral_event = "idle",
        idle_limit = ?limit,
        "nothing loaded or in flight for {}; exiting until the next connection",
        crate::durations::human(limit)
    );
    true
}

/// What the HTTP handlers share, from the configuration at start.
fn app_state(config: &Config, store: Store, scheduler: Handle, inventory: Arc<gpu::Inventory>) -> http::AppState {
    let registry = Registry::new(RegistryConfig {
        insecure: config.store.insecure_registries.clone(),
        ..RegistryConfig::default()
    });
    http::AppState {
        store,
        scheduler,
        safety: Arc::new(http::Safety::new(&config.server, http::LocalNames::system())),
        defaults: request::Defaults { num_ctx: config.scheduler.num_ctx, parallel: config.scheduler.num_parallel },
        registry,
        tokens: Arc::default(),
        upstream: crate::supervisor::upstream::Pool::new(config.runner.stream_idle_timeout),
        templates: crate::prompt_template::Renderer::default(),
        inventory,
    }
}

/// Serves the D-Bus interface, unless `[dbus] bus = "off"`. Without a bus (or the right
/// to own the name) corrald still serves HTTP: D-Bus is a view, and a missing bus on a
/// development machine must not stop the daemon.
async fn serve_dbus(config: &Config, state: &http::AppState) -> Option<dbus::Service> {
    if config.dbus.bus == BusKind::Off {
        return None;
    }
    let limits = limits(config, state.inventory.gpus.len());
    let context = dbus::Context {
        store: state.store.clone(),
        scheduler: state.scheduler.clone(),
        registry: state.registry.clone(),
        defaults: state.defaults,
        inventory: Arc::clone(&state.inventory),
        limits,
        read_only: config.store.read_only,
        tokens: Arc::clone(&state.tokens),
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
/// handle, the inventory and its task.
async fn start_scheduler(
    config: &Config,
    paths: &Paths,
    cgroups: Option<CgroupTree>,
    log_target: LogTarget,
) -> anyhow::Result<(Handle, gpu::Inventory, tokio::task::JoinHandle<()>)> {
    let gpu_config = config.gpu.clone();
    // The workers are asked through llama-server, as the runners will see them.
    let workers = gpu::rpc::Workers::new(config.runner.llama_server.clone(), config.workers.clone());
    let (probe, inventory) = tokio::task::spawn_blocking(move || {
        let probe: Arc<dyn gpu::MemoryProbe> = Arc::from(gpu::probe(&gpu_config, workers, &gpu::Roots::system()));
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
        // A worker's devices are reached through its address (`--rpc`).
        devices: inventory
            .gpus
            .iter()
            .map(|g| Device { backend: g.backend, id: g.endpoint.clone().unwrap_or_else(|| g.id.clone()) })
            .collect(),
        probe: Some(probe),
        projections: Projector::from_config(&config.runner, std::env::var_os("PATH").as_deref()).ok().map(
            |projector| {
                let cache = ProjectionCache::load(paths.state.join("projections.json"));
                Arc::new(CachedProjections::new(projector, cache)) as Arc<dyn Projections>
            },
        ),
    };
    let gpus: Vec<GpuView> = inventory
        .gpus
        .iter()
        .enumerate()
        .map(|(index, g)| GpuView { index, name: g.name.clone(), worker: g.endpoint.clone(), usable: g.free_bytes })
        .collect();
    let limits = limits(config, gpus.len());
    let max_loaded = limits.max_loaded;
    tracing::info!(
        gpus = inventory.gpus.len(),
        host_bytes = inventory.host.available_bytes,
        max_loaded,
        "scheduling on {} device(s) and {} bytes of host memory",
        inventory.gpus.len(),
        inventory.host.available_bytes
    );
    let learned = Footprints::load(paths.state.join("footprints.json"));
    let (scheduler, handle) = Scheduler::new(Arc::new(backend), gpus, inventory.host.available_bytes, limits, learned);
    let task = tokio::spawn(scheduler.run());
    Ok((handle, inventory, task))
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
        partial_offload: config.scheduler.partial_offload,
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
/// Returns whether a new one was applied.  The entry says which changed keys take effect
/// only at the next restart.
fn reload(
    source: &ConfigSource,
    base: &toml::Table,
    current: &mut Loaded,
    socket_activated: bool,
    notifier: &Notifier,
) -> bool {
    notifier.reloading();
    match source.load_over(base.clone()) {
        Ok(new) => {
            let changed = changed_keys(&current.table, &new.table);
            let later: Vec<String> =
                changed.iter().filter(|key| !applies_on_reload(key)).map(|key| shown_key(key)).collect();
            let listen_unused = socket_activated
                && changed
                    .iter()
                    .any(|k| k.first().is_some_and(|t| t == "server") && k.get(1).is_some_and(|k| k == "listen"));
            *current = new;
            if later.is_empty() {
                tracing::info!(corral_event = "reload", config_files = ?current.files, "configuration reloaded");
            } else {
                let list = later.join(", ");
                let socket_note = if listen_unused {
                    "; [server] listen applies only when systemd passes no socket (edit corrald.socket instead)"
                } else {
                    ""
                };
                tracing::warn!(
                    corral_event = "reload",
                    config_files = ?current.files,
                    restart_needed = %list,
                    "configuration reloaded, but these changed keys take effect only at the next restart \
                     (`systemctl restart corrald`): {list}{socket_note}"
                );
            }
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

/// The keys a reload applies to the running daemon; every other key is read at start only.
/// (A key added later needs a restart until it is added here.)
const RELOADED_KEYS: &[&str] = &[
    "scheduler.keep_alive",
    "scheduler.keep_alive_min",
    "scheduler.keep_alive_max",
    "scheduler.max_loaded_models",
    "scheduler.max_queue",
    "scheduler.partial_offload",
    "server.exit_on_idle",
    "server.shutdown_timeout",
];

fn applies_on_reload(key: &[String]) -> bool {
    RELOADED_KEYS.contains(&key.join(".").as_str())
}

/// `["server", "listen"]` as people write it: `[server] listen`; a model's policy as
/// `[models."NAME"] preload`.
fn shown_key(key: &[String]) -> String {
    match key {
        [workers] if workers == "workers" => "[[workers]]".to_owned(),
        [table] => format!("[{table}]"),
        [models, name, rest @ ..] if models == "models" => {
            let table = format!("[models.\"{name}\"]");
            if rest.is_empty() { table } else { format!("{table} {}", rest.join(".")) }
        }
        [table, rest @ ..] => format!("[{table}] {}", rest.join(".")),
        [] => String::new(),
    }
}

/// The keys whose value differs between two merged configurations (set, changed or
/// removed), down to the leaves of tables; arrays count as one value.
fn changed_keys(old: &toml::Table, new: &toml::Table) -> Vec<Vec<String>> {
    let mut changed = Vec::new();
    diff_tables(&mut Vec::new(), old, new, &mut changed);
    changed
}

fn diff_tables(prefix: &mut Vec<String>, old: &toml::Table, new: &toml::Table, out: &mut Vec<Vec<String>>) {
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for key in keys {
        prefix.push(key.clone());
        match (old.get(key), new.get(key)) {
            (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => diff_tables(prefix, a, b, out),
            (Some(toml::Value::Table(a)), None) => diff_tables(prefix, a, &toml::Table::new(), out),
            (None, Some(toml::Value::Table(b))) => diff_tables(prefix, &toml::Table::new(), b, out),
            (a, b) if a != b => out.push(prefix.clone()),
            _ => {}
        }
        prefix.pop();
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
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Activity, IdleClock, Vital, watchdog_ping};
    use crate::scheduler::actor::Scheduler;
    use crate::scheduler::backend::{Backend, BoxFuture, LiveRunner, StartRequest};
    use crate::scheduler::footprints::Footprints;
    use crate::scheduler::keep_alive::{Clamp, KeepAlive};
    use crate::scheduler::policy::Footprint;
    use crate::scheduler::types::{Limits, ModelRequest, ScheduleError};
    use crate::supervisor::command::{LoadOptions, ModelFiles};
    use crate::systemd::Notifier;

    /// A backend whose runners make the scheduler panic once ready: the only way to
    /// make it panic, reachable from this test alone.
    struct Panicking;

    struct PanickingRunner;

    impl Backend for Panicking {
        fn start(
            &self,
            _: StartRequest,
        ) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, crate::scheduler::failure::LoadFailure>> {
            Box::pin(async { Ok(Box::new(PanickingRunner) as Box<dyn LiveRunner>) })
        }
    }

    impl LiveRunner for PanickingRunner {
        fn socket(&self) -> PathBuf {
            panic!("the test backend's runner has no socket")
        }
        fn measured(&self) -> Option<Footprint> {
            None
        }
        fn pid(&self) -> u32 {
            1
        }
        fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
        fn exited(&mut self) -> BoxFuture<'_, String> {
            Box::pin(std::future::pending())
        }
    }

    fn scheduler(backend: Arc<dyn Backend>) -> (Scheduler, crate::scheduler::handle::Handle) {
        let limits = Limits {
            max_loaded: 3,
            max_queue: 8,
            default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
            clamp: Clamp::default(),
            partial_offload: true,
        };
        Scheduler::new(backend, Vec::new(), 1 << 30, limits, Footprints::in_memory())
    }

    fn request() -> ModelRequest {
        ModelRequest {
            key: crate::scheduler::key::RunnerKey::new(
                crate::scheduler::key::Weights::of(crate::store::digest::Digest::of(b"m")),
                &LoadOptions::default(),
            ),
            name: "m".into(),
            files: ModelFiles { model: PathBuf::from("/blobs/m"), projector: None, adapters: Vec::new() },
            options: LoadOptions::default(),
            need: Footprint { vram: 0, ram: 1 << 20 },
            layers: 0,
            keep_alive: None,
            pinned: false,
        }
    }

    /// Log lines, captured.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Capture {
        /// Everything logged on this thread until the guard drops.
        fn logs() -> (Self, tracing::subscriber::DefaultGuard) {
            let capture = Self::default();
            let writer = capture.clone();
            let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
            (capture, tracing::subscriber::set_default(subscriber))
        }
    }

    #[tokio::test]
    async fn a_panicking_scheduler_ends_the_daemon_with_an_error_naming_it_and_the_panic() {
        let (capture, _guard) = Capture::logs();
        let (scheduler, handle) = scheduler(Arc::new(Panicking));
        let mut vital = Vital { scheduler: tokio::spawn(scheduler.run()) };
        let waiting = tokio::spawn({
            let handle = handle.clone();
            async move { handle.acquire(request()).await }
        });
        let error = tokio::time::timeout(Duration::from_secs(30), vital.died(std::future::pending()))
            .await
            .expect("noticed at once");
        assert_eq!(error.to_string(), "the scheduler task panicked: the test backend's runner has no socket");
        let logged = String::from_utf8(capture.0.lock().expect("lock").clone()).expect("utf-8");
        assert!(
            logged.lines().any(|l| l.contains("ERROR")
                && l.contains("task=\"scheduler\"")
                && l.contains("the scheduler task panicked: the test backend's runner has no socket")),
            "{logged}"
        );
        // What waited on it is told, not left hanging.
        assert_eq!(waiting.await.expect("join").expect_err("no lease"), ScheduleError::ShuttingDown);
        assert_eq!(handle.ping().await, Err(ScheduleError::ShuttingDown));
    }

    #[tokio::test]
    async fn a_panicking_d_bus_follower_ends_the_daemon_with_an_error_naming_it() {
        // Logs captured here too: a callsite first reached with no subscriber anywhere
        // would stay off for the test above, which checks its entry.
        let (capture, _guard) = Capture::logs();
        let (scheduler, handle) = scheduler(Arc::new(Panicking));
        let mut vital = Vital { scheduler: tokio::spawn(scheduler.run()) };
        let follower = tokio::spawn(async { panic!("a view fell over") });
        let error = tokio::time::timeout(Duration::from_secs(30), vital.died(follower)).await.expect("noticed");
        assert_eq!(error.to_string(), "the D-Bus follower task panicked: a view fell over");
        let logged = String::from_utf8(capture.0.lock().expect("lock").clone()).expect("utf-8");
        assert!(logged.contains("task=\"D-Bus follower\""), "{logged}");
        // A follower that simply ends is as fatal: the views would freeze.
        let error = vital.died(async { Ok(()) }).await;
        assert_eq!(error.to_string(), "the D-Bus follower task ended unexpectedly");
        handle.shutdown().await;
    }

    #[tokio::test]
    async fn the_watchdog_is_pinged_only_after_the_scheduler_answered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let manager = std::os::unix::net::UnixDatagram::bind(&path).expect("bind");
        manager.set_nonblocking(true).expect("nonblocking");
        let notifier = Notifier::new(Some(path.into_os_string()));
        let mut buf = [0u8; 256];

        // A scheduler whose loop does not run (as when it hangs): no ping.
        let (_hung, hung_handle) = scheduler(Arc::new(Panicking));
        assert!(!watchdog_ping(&notifier, &hung_handle, Duration::from_millis(100)).await);
        let nothing = manager.recv(&mut buf).expect_err("no message");
        assert_eq!(nothing.kind(), std::io::ErrorKind::WouldBlock, "no WATCHDOG=1 for a hung scheduler");

        // A dead one: no ping either.
        let (dead, dead_handle) = scheduler(Arc::new(Panicking));
        drop(dead);
        assert!(!watchdog_ping(&notifier, &dead_handle, Duration::from_secs(5)).await);
        assert!(manager.recv(&mut buf).is_err());

        let (running, handle) = scheduler(Arc::new(Panicking));
        tokio::spawn(running.run());
        assert!(watchdog_ping(&notifier, &handle, Duration::from_secs(30)).await);
        let n = manager.recv(&mut buf).expect("a message");
        assert_eq!(&buf[..n], b"WATCHDOG=1\n");
    }

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).expect("toml")
    }

    #[test]
    fn a_reload_names_every_changed_key_that_needs_a_restart() {
        let old = table(
            "[server]\nlisten = [\"127.0.0.1:1\"]\n[scheduler]\nkeep_alive = \"5m\"\n[models.\"chat\"]\npreload = true\n",
        );
        let new = table(
            "[server]\nlisten = [\"127.0.0.1:2\"]\n[scheduler]\nkeep_alive = \"9m\"\nmax_queue = 3\n\
             [store]\npath = \"/x\"\n[runner]\nstream_idle_timeout = \"1m\"\n[dbus]\nbus = \"off\"\n\
             [[workers]]\naddress = \"h:1\"\n",
        );
        let changed = super::changed_keys(&old, &new);
        let later: Vec<String> =
            changed.iter().filter(|k| !super::applies_on_reload(k)).map(|k| super::shown_key(k)).collect();
        assert_eq!(
            later,
            [
                "[dbus] bus",
                "[models.\"chat\"] preload",
                "[runner] stream_idle_timeout",
                "[server] listen",
                "[store] path",
                "[[workers]]"
            ]
        );
        let live: Vec<String> = changed.iter().filter(|k| super::applies_on_reload(k)).map(|k| k.join(".")).collect();
        assert_eq!(live, ["scheduler.keep_alive", "scheduler.max_queue"]);
        assert!(super::changed_keys(&old, &old).is_empty());
    }

    #[test]
    fn a_missing_or_unusable_llama_server_names_the_key_and_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("llama-server");
        let text = super::find_llama_server(&missing).expect_err("missing").to_string();
        assert!(text.starts_with("[runner] llama_server: "), "{text}");
        assert!(text.contains(&format!("{} does not exist", missing.display())), "{text}");
        std::fs::write(&missing, "#!/bin/sh\n").expect("write");
        let text = super::find_llama_server(&missing).expect_err("not executable").to_string();
        assert!(text.contains("is not executable"), "{text}");
        let text = super::find_llama_server(dir.path()).expect_err("a directory").to_string();
        assert!(text.contains("is not a file"), "{text}");
        let text =
            super::find_llama_server(std::path::Path::new("no-such-llama-server-here")).expect_err("none").to_string();
        assert!(text.contains("\"no-such-llama-server-here\" is not found on PATH ("), "{text}");
        assert_eq!(
            super::find_llama_server(std::path::Path::new("sh")).expect("sh is on PATH").file_name(),
            Some("sh".as_ref())
        );
    }

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
