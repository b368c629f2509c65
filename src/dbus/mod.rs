//! The D-Bus control interface `org.corral.Corral1`: a view of the scheduler and the
//! store, like the HTTP API.
//!
//! - `manager`: `org.corral.Corral1.Manager` at `/org/corral/Corral1`, beside
//!   `org.freedesktop.DBus.ObjectManager` (`object_tree`);
//! - `model`: one `org.corral.Corral1.Model` object per stored model;
//! - `job`: `org.corral.Corral1.Job` objects for pull, push, create, copy and delete;
//! - `follow`: the task that keeps those objects in step with the scheduler's notices
//!   and the store's changes, and emits the signals;
//! - [`error`]: the named errors `org.corral.Corral1.Error.*`;
//! - [`proxy`]: client proxies, for `corralctl` and the tests;
//! - `bus_socket`: the connection's socket, holding every message corrald sends to the
//!   bus's size limit.
//!
//! The contract is `dbus/org.corral.Corral1.*.xml`; access is the bus policy
//! `dbus/org.corral.Corral1.conf` (no polkit). Nothing here holds scheduling state: it
//! sends messages to the scheduler's [`Handle`] like the HTTP handlers do.

mod bus_socket;
pub mod error;
mod follow;
mod job;
mod manager;
mod model;
mod object_tree;
mod options;
pub mod proxy;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use zbus::connection::Builder;
use zbus::zvariant::OwnedObjectPath;

use crate::config::BusKind;
use crate::scheduler::handle::Handle;
use crate::scheduler::request::Defaults;
use crate::scheduler::types::Limits;
use crate::store::Store;
use crate::store::registry::Registry;
use crate::sync::lock;

/// The well-known bus name.
pub const BUS_NAME: &str = "org.corral.Corral1";
/// The manager's (and the object manager's) path.
pub const ROOT_PATH: &str = "/org/corral/Corral1";
/// Where model objects live.
pub const MODELS_PATH: &str = "/org/corral/Corral1/models";
/// Where job objects live.
pub const JOBS_PATH: &str = "/org/corral/Corral1/jobs";

/// What the interface serves: handles on the daemon's parts and what it found at start.
#[derive(Debug, Clone)]
pub struct Context {
    /// The model store.
    pub store: Store,
    /// The scheduler.
    pub scheduler: Handle,
    /// The registry client (shared with the HTTP API, so pulls share downloads).
    pub registry: Registry,
    /// Load defaults from the configuration.
    pub defaults: Defaults,
    /// The devices (GPUs, then the workers' RPC devices), host memory and workers' health.
    pub fleet: crate::workers::FleetView,
    /// The scheduler's limits at start (reloads arrive as notices).
    pub limits: Limits,
    /// Whether the store refuses writes (`[store] read_only`).
    pub read_only: bool,
    /// Store jobs running at once (`[dbus] max_jobs`).
    pub max_jobs: u32,
    /// The HTTP API's token counters (each model's last speed).
    pub tokens: Arc<crate::http::state::Tokens>,
}

/// A running D-Bus service; dropping it stops following changes (the connection closes
/// once its last clone goes).
#[derive(Debug)]
pub struct Service {
    connection: zbus::Connection,
    follower: tokio::task::JoinHandle<()>,
    shared: Arc<Shared>,
}

impl Service {
    /// Jobs (pull, push, create, copy, delete) not finished yet: work in flight, for the
    /// idle check.
    #[must_use]
    pub fn jobs_running(&self) -> usize {
        self.shared.jobs_running.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The bus connection.
    pub fn connection(&self) -> &zbus::Connection {
        &self.connection
    }

    /// Resolves when the task that keeps the objects in step with the scheduler ends
    /// (it runs while the scheduler does; its end, or its panic, means the views froze).
    ///
    /// # Errors
    /// The task panicked.
    pub async fn follower(&mut self) -> Result<(), tokio::task::JoinError> {
        (&mut self.follower).await
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// Connects to `bus` and serves the manager; a task then serves an object per stored
/// model and only then takes the name `org.corral.Corral1` (so a client woken by the name
/// finds every object in place), and logs "serving D-Bus". That happens after this
/// returns: reading a large store must not delay `READY=1` (a client started in that
/// moment may not find the name yet).
pub async fn serve(bus: BusKind, context: Context) -> Result<Service, zbus::Error> {
    let address = match bus {
        BusKind::System => zbus::Address::system()?,
        BusKind::Session => zbus::Address::session()?,
        BusKind::Off => return Err(zbus::Error::Unsupported),
    };
    let builder = Builder::socket(bus_socket::connect(&address).await?);
    let shared = Arc::new(Shared::new(context));
    let connection = builder
        .serve_at(ROOT_PATH, object_tree::ObjectTree { shared: Arc::clone(&shared) })?
        .serve_at(ROOT_PATH, manager::Manager::new(Arc::clone(&shared)))?
        .build()
        .await?;
    let follower = follow::start(Arc::clone(&shared), connection.clone(), bus);
    Ok(Service { connection, follower, shared })
}

/// What the interface objects share.
#[derive(Debug)]
struct Shared {
    context: Context,
    /// Limits now (updated on reload).
    limits: Mutex<Limits>,
    /// The names of the models with a runner, in order, as `LoadedModels` last signalled them.
    loaded: Mutex<Vec<String>>,
    /// The model objects by the model's short name, with their data.
    models: Mutex<BTreeMap<String, model::Shown>>,
    /// Job numbers, and the finished jobs still shown.
    jobs: Mutex<job::Jobs>,
    /// Jobs not finished yet.
    jobs_running: std::sync::atomic::AtomicUsize,
    /// The runners as the views know them (the follower keeps them).
    runners: Mutex<follow::Runners>,
    /// Woken each time the follower applied a change.
    applied: tokio::sync::Notify,
    /// Whether the follower is in the middle of applying a change (the runners changed,
    /// the model objects and `LoadedModels` not yet).
    applying: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn new(context: Context) -> Self {
        Self {
            limits: Mutex::new(context.limits.clone()),
            loaded: Mutex::default(),
            models: Mutex::default(),
            jobs: Mutex::default(),
            jobs_running: std::sync::atomic::AtomicUsize::new(0),
            runners: Mutex::default(),
            applied: tokio::sync::Notify::new(),
            applying: std::sync::atomic::AtomicBool::new(false),
            context,
        }
    }

    /// Waits until the views show what `done` looks for, every view of the change (the
    /// runners, the model objects, `LoadedModels`), so that a reply never runs ahead of the
    /// properties a client reads next. Bounded: a view that falls behind delays a reply by
    /// a moment, never fails it.
    async fn settled(&self, done: impl Fn(&follow::Runners) -> bool) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let notified = self.applied.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let applying = self.applying.load(std::sync::atomic::Ordering::SeqCst);
            if !applying && done(&lock(&self.runners)) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }
}

/// The largest reply body corrald makes: the bus's message limit less room for the
/// header. A reply refused here names what to ask instead of it; [`bus_socket`] holds
/// every message to the limit, for the replies zbus writes itself.
const MAX_REPLY: usize = bus_socket::MAX_MESSAGE - (64 << 10);

/// What a text takes in a message besides its bytes: length (4), NUL (1), padding before
/// it (at most 3).
const TEXT: usize = 8;

/// The bytes texts of these lengths take at most.
fn texts(lengths: &mut dyn Iterator<Item = usize>) -> usize {
    lengths.map(|len| len + TEXT).sum()
}

/// Refuses a reply of `bytes` (at most) that one message cannot carry, with `LimitsExceeded`
/// naming `what` it would hold, and what to ask `instead`.
fn reply_fits(bytes: usize, what: &str, instead: &str) -> zbus::fdo::Result<()> {
    if bytes <= MAX_REPLY {
        return Ok(());
    }
    Err(zbus::fdo::Error::LimitsExceeded(format!(
        "{what} take up to {bytes} bytes, more than one message of the bus carries ({MAX_REPLY}); {instead}"
    )))
}

/// The object path of the model named `name` (its short form): every byte outside
/// `[A-Za-z0-9]` is written `_xx` in hex, as systemd escapes unit names in paths, so
/// that the path is valid and the name can be read back.
#[must_use]
pub fn model_path(name: &str) -> OwnedObjectPath {
    let mut path = String::with_capacity(MODELS_PATH.len() + 1 + name.len() * 3);
    path.push_str(MODELS_PATH);
    path.push('/');
    if name.is_empty() {
        path.push('_');
    }
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() {
            path.push(char::from(byte));
        } else {
            let _ = write!(path, "_{byte:02x}");
        }
    }
    OwnedObjectPath::try_from(path).expect("only [A-Za-z0-9_/] in the path")
}

#[cfg(test)]
mod tests {
    use super::model_path;

    #[test]
    fn model_paths_escape_every_byte_outside_letters_and_digits() {
        assert_eq!(model_path("tiny:latest").as_str(), "/org/corral/Corral1/models/tiny_3alatest");
        assert_eq!(model_path("me/my-model:1.0").as_str(), "/org/corral/Corral1/models/me_2fmy_2dmodel_3a1_2e0");
        assert_eq!(model_path("").as_str(), "/org/corral/Corral1/models/_");
        // Distinct names never share a path: the escape is reversible.
        assert_ne!(model_path("a_2f"), model_path("a/"));
    }
}
