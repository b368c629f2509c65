//! The health monitor task: checks every worker each interval (and at once when the
//! scheduler asks), applies the outcomes to its [`Fleet`], tells the views and the
//! scheduler, then logs each change as a `worker-up` / `worker-down` journal event.

use std::time::{Duration, SystemTime};

use futures_util::future::join_all;
use tokio::sync::{mpsc, watch};

use super::check::{CheckSettings, Connection, check};
use super::fleet::{Change, Fleet, Outcome, WorkerStatus};
use crate::config::WorkerConfig;
use crate::scheduler::handle::Handle;

/// Where the scheduler asks for workers (by address) to be checked now.
pub type Nudges = mpsc::Receiver<Vec<String>>;

/// The scheduler's side of [`Nudges`].
pub type Nudge = mpsc::Sender<Vec<String>>;

/// The channel of early checks: a few at most wait (each names the workers of one dead
/// runner); a scheduler that finds it full plans on as if it had not asked.
#[must_use]
pub fn nudges() -> (Nudge, Nudges) {
    mpsc::channel(16)
}

/// Checks every worker once, listing their devices, and logs what it found: the fleet
/// the daemon starts with.
pub async fn first_round(mut fleet: Fleet, workers: &[WorkerConfig], settings: &CheckSettings) -> Fleet {
    let checked = join_all(workers.iter().map(|w| check(w, settings, true, &[]))).await;
    let now = SystemTime::now();
    for (index, checked) in checked.into_iter().enumerate() {
        if let Some(change) = fleet.apply(index, checked.outcome, now) {
            log_change(&fleet.workers[index], change);
        }
    }
    fleet
}

/// Logs a worker's change of state as its journal event.
pub fn log_change(status: &WorkerStatus, change: Change) {
    match change {
        Change::Up => tracing::info!(
            corral_event = "worker-up",
            corral_worker = status.name.as_str(),
            corral_worker_address = status.address.as_str(),
            corral_worker_devices = status.devices.len(),
            "{} is up with {}",
            status.label(),
            crate::units::count(status.devices.len(), "device", "devices")
        ),
        Change::Down => tracing::warn!(
            corral_event = "worker-down",
            corral_worker = status.name.as_str(),
            corral_worker_address = status.address.as_str(),
            corral_reason = status.last_error.as_str(),
            "{}; its devices are left out until it is back",
            status.down_message()
        ),
    }
}

/// The task that owns the workers' health.
pub struct Monitor {
    /// The fleet it keeps.
    pub fleet: Fleet,
    /// The workers, in the fleet's order.
    pub workers: Vec<WorkerConfig>,
    /// How each check is made.
    pub settings: CheckSettings,
    /// How often every worker is checked.
    pub interval: Duration,
    /// The views' copy.
    pub views: watch::Sender<Fleet>,
    /// The scheduler, told of every change.
    pub scheduler: Handle,
    /// The scheduler's requests for an early check.
    pub nudges: Nudges,
}

/// The connections its runners last had to each worker (by index), until the worker is
/// listed again: reset before that listing, should the worker still hold one open.
#[derive(Debug, Default)]
struct LeftOpen(Vec<Vec<Connection>>);

impl LeftOpen {
    fn of(&self, index: usize) -> &[Connection] {
        self.0.get(index).map_or(&[], Vec::as_slice)
    }

    /// Remembers the connections a check saw; forgets them once the worker is listed.
    fn record(&mut self, index: usize, held: Vec<Connection>, outcome: &Outcome) {
        if self.0.len() <= index {
            self.0.resize_with(index + 1, Vec::new);
        }
        if !held.is_empty() {
            self.0[index] = held;
        } else if matches!(outcome, Outcome::Up { devices: Some(_), .. }) {
            self.0[index].clear();
        }
    }
}

impl Monitor {
    /// Runs until the scheduler is gone.
    pub async fn run(mut self) {
        let mut nudges = Some(self.nudges);
        let all: Vec<usize> = (0..self.workers.len()).collect();
        let mut left_open = LeftOpen::default();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // The first tick is now: the first round was at start.
        loop {
            let (which, asked) = tokio::select! {
                _ = tick.tick() => (all.clone(), false),
                nudge = recv(&mut nudges) => {
                    let Some(addresses) = nudge else {
                        nudges = None;
                        continue;
                    };
                    (addresses.iter().filter_map(|a| self.fleet.position(a)).collect(), true)
                }
            };
            let checked = join_all(
                which
                    .iter()
                    .map(|&i| check(&self.workers[i], &self.settings, self.fleet.needs_listing(i), left_open.of(i))),
            )
            .await;
            let now = SystemTime::now();
            let mut changes = Vec::new();
            for (&index, checked) in which.iter().zip(checked) {
                left_open.record(index, checked.held, &checked.outcome);
                if let Some(change) = self.fleet.apply(index, checked.outcome, now) {
                    changes.push((index, change));
                }
            }
            self.views.send_replace(self.fleet.clone());
            if !changes.is_empty() || asked {
                let checked = which.iter().map(|&i| self.fleet.workers[i].address.clone()).collect();
                if self.scheduler.fleet_changed(self.fleet.clone(), checked).await.is_err() {
                    return;
                }
            }
            // Logged once the scheduler's queue holds the news: a request sent after the
            // event is planned with it.
            for (index, change) in changes {
                log_change(&self.fleet.workers[index], change);
            }
        }
    }
}

/// The next nudge; pends forever once the channel is closed (`None` is returned once).
async fn recv(nudges: &mut Option<Nudges>) -> Option<Vec<String>> {
    match nudges {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Connection, LeftOpen, Outcome};

    fn connection(local: &str) -> Connection {
        Connection { local: local.parse().expect("local"), remote: "10.0.0.2:50052".parse().expect("remote") }
    }

    #[test]
    fn a_runners_connections_are_kept_until_the_worker_is_listed_again() {
        let mut left = LeftOpen::default();
        assert!(left.of(3).is_empty(), "nothing for a worker never seen held");
        let held = vec![connection("10.0.0.1:40000"), connection("10.0.0.1:40001")];
        left.record(1, held.clone(), &Outcome::Busy);
        assert_eq!(left.of(1), held.as_slice());
        assert!(left.of(0).is_empty());
        // Down, then reachable but not listed: still to be reset.
        left.record(1, Vec::new(), &Outcome::Down("cut off".into()));
        left.record(1, Vec::new(), &Outcome::Up { rtt: Duration::from_millis(1), devices: None });
        assert_eq!(left.of(1), held.as_slice());
        // A newer runner's connections replace them.
        let newer = vec![connection("10.0.0.1:41000")];
        left.record(1, newer.clone(), &Outcome::Busy);
        assert_eq!(left.of(1), newer.as_slice());
        // Listed again: the worker serves, nothing is left to reset.
        left.record(1, Vec::new(), &Outcome::Up { rtt: Duration::from_millis(1), devices: Some(Vec::new()) });
        assert!(left.of(1).is_empty());
    }
}
