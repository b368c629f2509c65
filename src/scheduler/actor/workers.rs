//! What RPC workers coming and going do to the scheduler's state.
//!
//! The health monitor ([`crate::workers`]) sends every change of the fleet; the
//! scheduler plans only with devices that are online and whose worker is not suspect,
//! stops at once (SIGKILL) the runners of a worker that went down, and, when a runner
//! that used workers dies, marks those workers suspect and asks the monitor to check
//! them before planning on them again; a load that would go on them waits for that check
//! rather than going elsewhere.  A request whose runner failed under it asks for
//! the runner's fate ([`Scheduler::await_fate`]), answered once the runner is gone and
//! its workers are checked, naming the worker that went down.

use std::collections::{BTreeSet, VecDeque};

use tokio::sync::oneshot;

use super::{Phase, Scheduler, Stop};
use crate::scheduler::failure::{FailureClass, LoadFailure};
use crate::scheduler::policy::{self, Decision, GpuView, Need, Placement, RunnerId, Snapshot};
use crate::scheduler::types::UnloadReason;
use crate::workers::{Fleet, Nudge, WorkerStatus};

/// How many ended runners' fates are remembered for requests that ask late.
const REMEMBERED: usize = 64;

/// The scheduler's side of the workers.
#[derive(Debug, Default)]
pub(crate) struct FleetState {
    /// The devices of down workers, by inventory index.
    offline: BTreeSet<usize>,
    /// Workers (by address) to be checked before they are planned with again.
    suspect: BTreeSet<String>,
    /// Each worker's health, as the monitor last said.
    workers: Vec<WorkerStatus>,
    /// Where to ask the monitor for an early check; none without workers.
    nudges: Option<Nudge>,
    /// Requests waiting for a runner's fate.
    waiting: Vec<(RunnerId, oneshot::Sender<Option<String>>)>,
    /// The latest ended runners: why, and the workers they used.
    ended: VecDeque<(RunnerId, String, Vec<String>)>,
}

impl Scheduler {
    /// Plans with the workers of `fleet` (its devices already among the GPUs given to
    /// [`Scheduler::new`], by the same indices), and asks `nudges` for early checks.
    #[must_use]
    pub fn with_workers(mut self, fleet: &Fleet, nudges: Nudge) -> Self {
        self.fleet.offline.clone_from(&fleet.inventory.offline);
        self.fleet.workers.clone_from(&fleet.workers);
        self.fleet.nudges = Some(nudges);
        self
    }

    /// The GPUs to plan with: online, and not on a suspect worker.
    pub(super) fn usable_gpus(&self) -> Vec<GpuView> {
        self.online_gpus().filter(|g| g.worker.as_ref().is_none_or(|w| !self.fleet.suspect.contains(w))).collect()
    }

    /// The GPUs whose worker (if any) is up.
    fn online_gpus(&self) -> impl Iterator<Item = GpuView> + '_ {
        self.gpus.iter().filter(|g| !self.fleet.offline.contains(&g.index)).cloned()
    }

    /// Whether workers are being checked before they are planned with again.
    pub(super) fn checking_workers(&self) -> bool {
        !self.fleet.suspect.is_empty()
    }

    /// Whether `need`, which `snapshot` places (or makes room for) without the workers
    /// being checked, would be placed on one of them at once were they not being checked.
    pub(super) fn awaits_checked_workers(&self, snapshot: &Snapshot, need: Need) -> bool {
        if !self.checking_workers() {
            return false;
        }
        let with_them = Snapshot { gpus: self.online_gpus().collect(), ..snapshot.clone() };
        match policy::decide(&with_them, need) {
            Decision::Load(placement) => self.workers_of(&placement).iter().any(|w| self.fleet.suspect.contains(w)),
            _ => false,
        }
    }

    /// The down workers, each with why, for messages.
    pub(super) fn down_workers(&self) -> Vec<String> {
        self.fleet.workers.iter().filter(|w| !w.up).map(|w| format!("{}: {}", w.label(), w.last_error)).collect()
    }

    /// The monitor's news: new device figures and slots, workers up or down (`checked`:
    /// the workers it has just checked, no longer suspect).
    pub(super) fn fleet_changed(&mut self, fleet: Fleet, checked: &[String]) {
        self.backend.devices_changed(&fleet.inventory.gpus);
        self.gpus = GpuView::all(&fleet.inventory);
        self.fleet.offline = fleet.inventory.offline;
        self.fleet.workers = fleet.workers;
        for address in checked {
            self.fleet.suspect.remove(address);
        }
        // The runners of a down worker cannot finish anything: out of service and killed now.
        let doomed: Vec<(RunnerId, String)> = self
            .runners
            .iter()
            .filter(|(_, e)| e.unload_detail.is_none())
            .filter_map(|(id, e)| self.down_worker_of(&e.placement).map(|why| (*id, why)))
            .collect();
        for (id, why) in doomed {
            if let Some(entry) = self.runners.get_mut(&id) {
                if let (Phase::Loading { waiters }, Some(task)) = (&mut entry.phase, entry.load_task.take()) {
                    // A load onto a worker that is gone would wait for llama.cpp to give up
                    // connecting (minutes): called off now, its child killed with its task.
                    task.abort();
                    let waiters = std::mem::take(waiters);
                    self.load_failed(id, waiters, LoadFailure::new(FailureClass::Crashed, why));
                    continue;
                }
                tracing::warn!(corral_event = "unload", corral_model = %entry.main(), runner = id, "stopping {} at once: {why}", entry.served());
                entry.unload_detail = Some(why);
                entry.draining = true;
            }
            self.stop_runner(id, UnloadReason::WorkerDown, Stop::Now);
        }
        self.answer_fates();
        self.schedule();
    }

    /// The first down worker among those `placement` uses, as a message.
    fn down_worker_of(&self, placement: &Placement) -> Option<String> {
        let used = self.workers_of(placement);
        self.fleet.workers.iter().find(|w| !w.up && used.contains(&w.address)).map(WorkerStatus::down_message)
    }

    /// The workers (addresses) whose devices `placement` uses.
    fn workers_of(&self, placement: &Placement) -> Vec<String> {
        let mut workers: Vec<String> = placement
            .devices()
            .iter()
            .filter_map(|index| self.gpus.iter().find(|g| g.index == *index).and_then(|g| g.worker.clone()))
            .collect();
        workers.dedup();
        workers
    }

    /// A runner at `placement` died or failed to load: its workers are suspect until the
    /// monitor has checked them.
    pub(super) fn suspect(&mut self, placement: &Placement) {
        let workers = self.workers_of(placement);
        if workers.is_empty() {
            return;
        }
        let Some(nudges) = &self.fleet.nudges else { return };
        // Full or gone: no check is coming, so nothing is held back for one.
        if nudges.try_send(workers.clone()).is_ok() {
            self.fleet.suspect.extend(workers);
        }
    }

    /// Runner `id` (at `placement`) ended, for `why`.
    pub(super) fn ended(&mut self, id: RunnerId, placement: &Placement, why: String) {
        let workers = self.workers_of(placement);
        if self.fleet.ended.len() == REMEMBERED {
            self.fleet.ended.pop_front();
        }
        self.fleet.ended.push_back((id, why, workers));
        self.answer_fates();
    }

    /// Answers with why runner `id` ended, once it has and its workers were checked;
    /// `None` for a runner this scheduler does not know.
    pub(super) fn await_fate(&mut self, id: RunnerId, reply: oneshot::Sender<Option<String>>) {
        self.fleet.waiting.push((id, reply));
        self.answer_fates();
    }

    fn answer_fates(&mut self) {
        let waiting = std::mem::take(&mut self.fleet.waiting);
        for (id, reply) in waiting {
            if reply.is_closed() {
                continue;
            }
            if self.runners.contains_key(&id) {
                self.fleet.waiting.push((id, reply));
                continue;
            }
            let Some((_, why, workers)) = self.fleet.ended.iter().find(|(ended, ..)| *ended == id) else {
                let _ = reply.send(None);
                continue;
            };
            if workers.iter().any(|w| self.fleet.suspect.contains(w)) {
                self.fleet.waiting.push((id, reply));
                continue;
            }
            let down: Vec<String> = self
                .fleet
                .workers
                .iter()
                .filter(|w| !w.up && workers.contains(&w.address))
                .map(WorkerStatus::down_message)
                .collect();
            let fate = if down.is_empty() || down.iter().any(|d| d == why) {
                why.clone()
            } else {
                format!("{}; the runner: {why}", down.join("; "))
            };
            let _ = reply.send(Some(fate));
        }
    }
}
