//! The daemon's lifecycle: listen, report ready, reload on SIGHUP, stop on SIGTERM.
//!
//! This is the composition root: it wires the configuration, the listeners and the
//! HTTP router together, owns the signal handlers and the watchdog, and keeps the
//! `STATUS=` line current.  Every lifecycle step is logged with a `corral_event`
//! field (`start`, `ready`, `reload`, `stop`).

use std::os::fd::OwnedFd;
use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::{ConfigSource, Loaded};
use crate::http::{self, listeners};
use crate::paths::Paths;
use crate::store::Store;
use crate::supervisor::cgroup::CgroupTree;
use crate::systemd::Notifier;

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
}

/// Runs the daemon until SIGTERM or SIGINT, then shuts down within `[server] shutdown_timeout`.
pub async fn run(daemon: Daemon) -> anyhow::Result<()> {
    let Daemon { source, loaded, paths, sockets, notifier, watchdog } = daemon;
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

    // Held for the runners the scheduler starts; taking it moves the daemon into its leaf.
    let _cgroups = take_cgroup_tree();
    let store_path = loaded.config.store.path.clone().unwrap_or_else(|| paths.default_store());
    let read_only = loaded.config.store.read_only;
    let _store = tokio::task::spawn_blocking(move || {
        if read_only { Store::open_read_only(&store_path) } else { Store::open(&store_path) }
    })
    .await
    .context("the store check panicked")?
    .context("cannot open the model store")?;

    let socket_activated = !sockets.is_empty();
    let listeners = if socket_activated {
        listeners::adopt(sockets)?
    } else {
        listeners::bind(&loaded.config.server.listen).await?
    };
    let names: Vec<String> = listeners.iter().map(listeners::Listener::describe).collect();
    let status = format!("serving on {}; 0 models loaded", names.join(", "));

    let shutdown = CancellationToken::new();
    let mut servers = JoinSet::new();
    let router = http::router();
    for listener in listeners {
        servers.spawn(listener.serve(router.clone(), shutdown.clone()));
    }
    // The sockets are listening and their accept loops are spawned: connections are served.
    notifier.ready(&status);
    tracing::info!(corral_event = "ready", listeners = ?names, socket_activated, "corrald ready: {status}");

    let mut watchdog_tick = watchdog.map(|interval| tokio::time::interval(interval / 2));
    let failure = loop {
        tokio::select! {
            _ = sigterm.recv() => break None,
            _ = sigint.recv() => break None,
            _ = sighup.recv() => {
                reload(&source, &mut loaded, socket_activated, &notifier);
                notifier.ready(&status);
            }
            () = tick(watchdog_tick.as_mut()) => notifier.watchdog(),
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
    if let Some(e) = failure {
        return Err(e);
    }
    tracing::info!("corrald stopped");
    Ok(())
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
fn reload(source: &ConfigSource, current: &mut Loaded, socket_activated: bool, notifier: &Notifier) {
    notifier.reloading();
    match source.load() {
        Ok(new) => {
            if !socket_activated && new.config.server.listen != current.config.server.listen {
                tracing::warn!("server.listen changed; the new addresses take effect at the next start");
            }
            *current = new;
            tracing::info!(corral_event = "reload", config_files = ?current.files, "configuration reloaded");
        }
        Err(e) => {
            tracing::error!(
                corral_event = "reload",
                error = %e,
                "configuration rejected, keeping the previous one: {e}"
            );
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
