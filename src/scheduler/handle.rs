//! The scheduler's address: a [`Handle`] sends the loop its messages and awaits the
//! answers; a [`Lease`] holds a ready runner for one request. The loop that answers is
//! [`actor`](super::actor).

use std::path::PathBuf;

use tokio::sync::{broadcast, mpsc, oneshot};

use super::backend::{LiveRunner, Projected};
use super::failure::LoadFailure;
use super::key::RunnerKey;
use super::policy::RunnerId;
use super::types::{Limits, LoadedModel, ModelRequest, Notice, ScheduleError, Stats};

/// A granted runner. Dropping it ends the request's hold.
#[derive(Debug)]
pub struct Lease {
    pub(super) runner: RunnerId,
    pub(super) socket: PathBuf,
    pub(super) events: mpsc::UnboundedSender<Event>,
}

impl Lease {
    /// The runner's UNIX socket.
    #[must_use]
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// The runner's id.
    #[must_use]
    pub fn runner(&self) -> RunnerId {
        self.runner
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Drop cannot await: the release goes through an unbounded channel.
        let _ = self.events.send(Event::Released { runner: self.runner });
    }
}

/// The scheduler's address.
#[derive(Debug, Clone)]
pub struct Handle {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) notices: broadcast::Sender<Notice>,
}

impl Handle {
    /// A lease on a ready runner for `request`, loading it first if needed. Resolves when
    /// the runner is ready (or with why it will not be).
    pub async fn acquire(&self, request: ModelRequest) -> Result<Lease, ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Acquire { request: Box::new(request), reply }).await?;
        answer.await.map_err(|_| ScheduleError::ShuttingDown)?
    }

    /// Unloads the runner with this key; resolves once its child is reaped. A busy runner
    /// takes no new requests and unloads when its requests end.
    pub async fn unload(&self, key: &RunnerKey) -> Result<(), ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Unload { key: key.clone(), reply }).await?;
        answer.await.map_err(|_| ScheduleError::ShuttingDown)?
    }

    /// Unloads every runner serving the model named `name` (display name); resolves once
    /// their children are reaped. [`ScheduleError::NotLoaded`] when none runs. A runner
    /// shared with other models is one process: it stops for all of them.
    ///
    /// One message: the loop picks the runners and takes them out of service in one
    /// step, so a request handled meanwhile cannot change which runners those are.
    pub async fn unload_model(&self, name: &str) -> Result<(), ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::UnloadModel { name: name.to_owned(), reply }).await?;
        let reaped = answer.await.map_err(|_| ScheduleError::ShuttingDown)??;
        for runner in reaped {
            runner.await.map_err(|_| ScheduleError::ShuttingDown)??;
        }
        Ok(())
    }

    /// Notices of what changes from now on.
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// The loaded models.
    pub async fn loaded(&self) -> Result<Vec<LoadedModel>, ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Loaded { reply }).await?;
        answer.await.map_err(|_| ScheduleError::ShuttingDown)
    }

    /// The scheduler's counters, queue depth and runners.
    pub async fn stats(&self) -> Result<Stats, ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Stats { reply }).await?;
        answer.await.map_err(|_| ScheduleError::ShuttingDown)
    }

    /// Applies new limits (after a configuration reload); loaded runners keep their
    /// keep-alive until their next request. A lower `max_loaded` applies at once: idle
    /// runners beyond it unload now, busy ones take no new requests and unload when
    /// their requests end ([`policy::shed`](super::policy::shed)).
    pub async fn reconfigure(&self, limits: Limits) {
        let _ = self.send(Command::Reconfigure { limits }).await;
    }

    /// Reports that the runner of `lease` is dead (its socket refused or reset a request
    /// before anything came back), ahead of its own crash report: it takes no new
    /// requests and goes once its requests end, so the next [`Handle::acquire`] (ordered
    /// after this report) loads a fresh one.
    pub async fn report_dead(&self, lease: Lease) {
        let _ = self.send(Command::Dead { runner: lease.runner }).await;
        drop(lease);
    }

    /// The health monitor's news: the fleet now, and the workers (by address) it has just
    /// checked. Runners of a worker that went down are killed; planning follows the
    /// fleet.
    ///
    /// # Errors
    /// [`ScheduleError::ShuttingDown`] when the scheduler is gone.
    pub async fn fleet_changed(&self, fleet: crate::workers::Fleet, checked: Vec<String>) -> Result<(), ScheduleError> {
        self.send(Command::Fleet { fleet: Box::new(fleet), checked }).await
    }

    /// Why runner `runner` ended, once it has (and the workers it used were checked):
    /// for a request whose answer broke off. `None` when the scheduler does not know it.
    /// The caller bounds the wait: a runner that is still alive never answers.
    pub async fn fate(&self, runner: RunnerId) -> Option<String> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Fate { runner, reply }).await.ok()?;
        answer.await.ok().flatten()
    }

    /// A round trip through the scheduler's loop: resolves once the loop took the
    /// message, which proves it runs (the watchdog pings only then).
    ///
    /// # Errors
    /// [`ScheduleError::ShuttingDown`] when the scheduler is gone.
    pub async fn ping(&self) -> Result<(), ScheduleError> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Ping { reply }).await?;
        answer.await.map_err(|_| ScheduleError::ShuttingDown)
    }

    /// Stops every runner and ends the scheduler; resolves once all children are reaped.
    pub async fn shutdown(&self) {
        let (reply, answer) = oneshot::channel();
        if self.send(Command::Shutdown { reply }).await.is_ok() {
            let _ = answer.await;
        }
    }

    async fn send(&self, command: Command) -> Result<(), ScheduleError> {
        self.commands.send(command).await.map_err(|_| ScheduleError::ShuttingDown)
    }
}

/// A runner's unload under way: answered once its child is reaped.
pub(super) type Reaped = oneshot::Receiver<Result<(), ScheduleError>>;

/// What a [`Handle`] asks of the loop.
pub(super) enum Command {
    Acquire {
        request: Box<ModelRequest>,
        reply: oneshot::Sender<Result<Lease, ScheduleError>>,
    },
    Unload {
        key: RunnerKey,
        reply: oneshot::Sender<Result<(), ScheduleError>>,
    },
    /// Answered at once with the unloads of the runners serving `name`, already begun.
    UnloadModel {
        name: String,
        reply: oneshot::Sender<Result<Vec<Reaped>, ScheduleError>>,
    },
    Loaded {
        reply: oneshot::Sender<Vec<LoadedModel>>,
    },
    Reconfigure {
        limits: Limits,
    },
    Dead {
        runner: RunnerId,
    },
    Fleet {
        fleet: Box<crate::workers::Fleet>,
        checked: Vec<String>,
    },
    Fate {
        runner: RunnerId,
        reply: oneshot::Sender<Option<String>>,
    },
    Ping {
        reply: oneshot::Sender<()>,
    },
    Stats {
        reply: oneshot::Sender<Stats>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// What the runners' tasks and the leases report to the loop.
#[derive(Debug)]
pub(super) enum Event {
    Started { runner: RunnerId, result: Result<Box<dyn LiveRunner>, LoadFailure> },
    Projected { key: RunnerKey, result: Result<Projected, String> },
    Released { runner: RunnerId },
    Stopped { runner: RunnerId },
    Crashed { runner: RunnerId, reason: String },
}

impl std::fmt::Debug for dyn LiveRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "runner pid {}", self.pid())
    }
}
