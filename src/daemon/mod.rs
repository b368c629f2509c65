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
//!
//! [`run`] is the loop; each job it calls on has a file: `start` builds the parts,
//! `reload` reads the configuration again, `supervise` watches the vital tasks and pings
//! the watchdog, `idle` decides when to exit on idle, `llama_server` checks the
//! configured executable, and [`refuse()`] answers while the configuration is rejected.

use std::os::fd::OwnedFd;
use std::time::Duration;

use anyhow::Context;
use axum::middleware::from_fn_with_state;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::LogTarget;
use crate::config::{ConfigSource, Loaded};
use crate::http::{self, listeners};
use crate::paths::Paths;
use crate::scheduler::handle::Handle as SchedulerHandle;
use crate::store::Store;
use crate::systemd::Notifier;

mod idle;
mod llama_server;
mod refuse;
mod reload;
mod start;
mod supervise;

pub use llama_server::{LlamaServerProblem, find_llama_server};
pub use refuse::refuse;

use idle::{IdleClock, Requests, count_requests, idle_exit_due};
use llama_server::check_llama_server;
use start::{
    after_ready, app_state, keep_tags_ready, limits, listen, listing_file, log_start, open_store, preload,
    raise_open_files_limit, save_listing, serve_dbus, start_scheduler, take_cgroup_tree, wait_synced,
};
use supervise::{Vital, follower, tick, watchdog_ping};

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
    // Listen before any runner starts: a start that fails to listen leaves nothing behind.
    let socket_activated = !sockets.is_empty();
    let listeners = listen(sockets, &loaded.config).await?;
    let (scheduler, fleet, scheduler_task) = start_scheduler(&loaded.config, &paths, cgroups, log_target).await?;
    let gpu_count = fleet.inventory().gpus.len();
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
    let state = app_state(&loaded.config, store.clone(), scheduler.clone(), fleet);
    keep_tags_ready(&state).await;
    // Connected before READY=1; the name follows once every model's object is served.
    let mut bus = serve_dbus(&loaded.config, &state).await;
    let router = http::router(state).layer(from_fn_with_state(requests.clone(), count_requests));
    for listener in listeners {
        servers.spawn(listener.serve(router.clone(), listeners::Timeouts::of(&loaded.config.server), shutdown.clone()));
    }
    // The sockets are listening and their accept loops are spawned: connections are served.
    notifier.ready(&status);
    tracing::info!(corral_event = "ready", listeners = ?names, socket_activated, "corrald ready: {status}");
    after_ready(&loaded.config, &store, listing_file(&paths));

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
                if reload::reload(&source, &base, &mut loaded, socket_activated, &notifier) {
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
    stop(servers, &scheduler, store, &paths, loaded.config.server.shutdown_timeout).await;
    if let Some(e) = failure {
        return Err(e);
    }
    tracing::info!("corrald stopped");
    Ok(())
}

/// Lets open connections finish within `grace`, then stops and reaps every runner, waits
/// for new blobs to reach the disk and saves the store's listing.
async fn stop(
    mut servers: JoinSet<std::io::Result<()>>,
    scheduler: &SchedulerHandle,
    store: Store,
    paths: &Paths,
    grace: Duration,
) {
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
    wait_synced(&store, grace).await;
    save_listing(store, paths).await;
}
