//! The workers' membership as a pure state: which are up, which devices each brought into
//! the inventory, and what the views show.  [`Fleet::apply`] takes one check's
//! [`Outcome`] and says what changed; no processes, sockets or clocks (the time is
//! passed in), so every transition is tested directly.

use std::time::{Duration, SystemTime};

use crate::config::WorkerConfig;
use crate::gpu::{Gpu, Inventory};

/// One worker as the views (D-Bus `Workers`, `/metrics`) show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerStatus {
    /// Its name (its address when unnamed).
    pub name: String,
    /// Its `HOST:PORT`.
    pub address: String,
    /// Whether its devices are in the inventory.
    pub up: bool,
    /// The ids of its devices (as `Devices` names them), once it was seen up.
    pub devices: Vec<String>,
    /// Why it is down; empty when up.
    pub last_error: String,
    /// How long the last successful check's connection took.
    pub rtt: Option<Duration>,
    /// When it entered its state.
    pub since: SystemTime,
    /// How many checks it had.
    pub checks: u64,
}

impl WorkerStatus {
    /// "worker NAME (ADDRESS)", for messages.
    #[must_use]
    pub fn label(&self) -> String {
        format!("worker {} ({})", self.name, self.address)
    }

    /// "worker NAME (ADDRESS) is down: WHY", for messages.
    #[must_use]
    pub fn down_message(&self) -> String {
        format!("{} is down: {}", self.label(), self.last_error)
    }
}

/// What one check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It accepted a connection in `rtt`; `devices` when it was also asked for them
    /// (already capped and reserved as the inventory holds them).
    Up {
        /// The connection's time.
        rtt: Duration,
        /// Its devices, when listed.
        devices: Option<Vec<Gpu>>,
    },
    /// A runner holds it, and the runner's connection to it is healthy (it was not
    /// connected to: it serves one client at a time).
    Busy,
    /// It could not be reached, or did not answer as an rpc-server does.
    Down(String),
}

/// A change of a worker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// It came up (first seen, or back).
    Up,
    /// It went down (or was found down at the first check).
    Down,
}

/// The inventory with the workers' devices in it, and each worker's health.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fleet {
    /// The local devices, then every worker device ever seen; a down worker's indices are
    /// in `offline`.
    pub inventory: Inventory,
    /// Each worker, in the configuration's order.
    pub workers: Vec<WorkerStatus>,
    /// Each worker's indices in `inventory.gpus`.
    slots: Vec<Vec<usize>>,
}

impl Fleet {
    /// The local inventory with `workers`, none of them checked yet (down, without devices).
    #[must_use]
    pub fn new(local: Inventory, workers: &[WorkerConfig], now: SystemTime) -> Self {
        Self {
            inventory: local,
            workers: workers
                .iter()
                .map(|w| WorkerStatus {
                    name: w.name().to_owned(),
                    address: w.address.as_str().to_owned(),
                    up: false,
                    devices: Vec::new(),
                    last_error: "not checked yet".to_owned(),
                    rtt: None,
                    since: now,
                    checks: 0,
                })
                .collect(),
            slots: vec![Vec::new(); workers.len()],
        }
    }

    /// Whether worker `index`'s next check must also list its devices: it is not up, so
    /// its devices are not known to be what they were (or were never known).
    #[must_use]
    pub fn needs_listing(&self, index: usize) -> bool {
        self.workers.get(index).is_some_and(|w| !w.up)
    }

    /// The worker at `address`, by index.
    #[must_use]
    pub fn position(&self, address: &str) -> Option<usize> {
        self.workers.iter().position(|w| w.address == address)
    }

    /// Applies one check of worker `index`; returns its change of state, if any (a first
    /// check that finds it down is a change: it is reported once).
    ///
    /// Up with devices: the worker's slots are refreshed in place when it lists as many
    /// devices as before, else it gets new slots (the old ones stay offline, so indices
    /// held by runners never change meaning).  Up without a listing while down keeps it
    /// down: its devices are not known.
    pub fn apply(&mut self, index: usize, outcome: Outcome, now: SystemTime) -> Option<Change> {
        let status = self.workers.get_mut(index)?;
        let (first, was_up) = (status.checks == 0, status.up);
        status.checks += 1;
        let change = match outcome {
            Outcome::Up { rtt, devices: Some(devices) } => {
                self.place(index, devices);
                let status = &mut self.workers[index];
                status.rtt = Some(rtt);
                status.last_error.clear();
                status.up = true;
                (!was_up).then_some(Change::Up)
            }
            Outcome::Up { rtt, devices: None } => {
                self.workers[index].rtt = Some(rtt);
                None
            }
            Outcome::Busy => None,
            Outcome::Down(why) => {
                self.inventory.offline.extend(self.slots[index].iter().copied());
                let status = &mut self.workers[index];
                status.last_error = why;
                status.up = false;
                (was_up || first).then_some(Change::Down)
            }
        };
        if change.is_some() {
            self.workers[index].since = now;
        }
        change
    }

    /// Puts a worker's listed devices into the inventory.
    fn place(&mut self, index: usize, devices: Vec<Gpu>) {
        let slots = &mut self.slots[index];
        if slots.len() == devices.len() {
            for (&slot, device) in slots.iter().zip(devices) {
                self.inventory.gpus[slot] = device;
            }
        } else {
            self.inventory.offline.extend(slots.iter().copied());
            let start = self.inventory.gpus.len();
            *slots = (start..start + devices.len()).collect();
            self.inventory.gpus.extend(devices);
        }
        for slot in &self.slots[index] {
            self.inventory.offline.remove(slot);
        }
        self.workers[index].devices = self.slots[index].iter().map(|&s| self.inventory.gpus[s].id.clone()).collect();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::{Change, Fleet, Outcome};
    use crate::config::WorkerConfig;
    use crate::gpu::{Backend, Gpu, HostMemory, Inventory};

    fn worker(address: &str, name: Option<&str>) -> WorkerConfig {
        WorkerConfig {
            address: address.parse().expect("address"),
            name: name.map(str::to_owned),
            memory: None,
            allow_public: false,
        }
    }

    fn device(address: &str, index: u32, free: u64) -> Gpu {
        Gpu {
            index,
            id: format!("rpc:{address}#{index}"),
            name: address.to_owned(),
            backend: Backend::Rpc,
            total_bytes: 100,
            free_bytes: free,
            driver: None,
            compute: None,
            endpoint: Some(address.to_owned()),
        }
    }

    fn local() -> Inventory {
        let mut gpu = device("x:1", 0, 1);
        gpu.id = "GPU-local".into();
        gpu.backend = Backend::Cuda;
        gpu.endpoint = None;
        Inventory {
            gpus: vec![gpu],
            host: HostMemory { total_bytes: 10, available_bytes: 5 },
            offline: std::collections::BTreeSet::new(),
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn up(devices: Option<Vec<Gpu>>) -> Outcome {
        Outcome::Up { rtt: Duration::from_millis(1), devices }
    }

    #[test]
    fn workers_join_in_order_leave_by_index_and_come_back_in_their_slots() {
        let mut fleet = Fleet::new(local(), &[worker("a:1", None), worker("b:2", Some("bee"))], at(0));
        assert!(fleet.workers.iter().all(|w| !w.up && w.last_error == "not checked yet"));
        assert!(fleet.needs_listing(0) && fleet.needs_listing(1));

        // b answers first: its device takes the first free index.
        assert_eq!(fleet.apply(1, up(Some(vec![device("b:2", 0, 50)])), at(1)), Some(Change::Up));
        assert_eq!(fleet.apply(0, Outcome::Down("refused".into()), at(1)), Some(Change::Down), "reported once");
        assert_eq!(fleet.apply(0, Outcome::Down("refused".into()), at(2)), None, "not again");
        assert_eq!(fleet.workers[1].devices, ["rpc:b:2#0"]);
        assert_eq!(fleet.workers[0].last_error, "refused");

        // a comes up with two devices: indices 2 and 3.
        assert_eq!(fleet.apply(0, up(Some(vec![device("a:1", 0, 10), device("a:1", 1, 20)])), at(3)), Some(Change::Up));
        let ids: Vec<_> = fleet.inventory.online().map(|(i, g)| (i, g.id.as_str())).collect();
        assert_eq!(ids, [(0, "GPU-local"), (1, "rpc:b:2#0"), (2, "rpc:a:1#0"), (3, "rpc:a:1#1")]);
        assert!(!fleet.needs_listing(0), "an up worker is only connected to");
        assert_eq!(fleet.apply(0, Outcome::Busy, at(3)), None, "held by a runner, healthy: still up");
        assert!(fleet.workers[0].up);
        assert_eq!(fleet.apply(1, Outcome::Busy, at(3)), None, "no news: still up");
        assert_eq!((fleet.workers[0].checks, fleet.workers[1].checks), (4, 2), "every check counts");

        // b goes down: its index stays, offline; a check without a listing keeps it down.
        assert_eq!(fleet.apply(1, Outcome::Down("no connection within 3 s".into()), at(4)), Some(Change::Down));
        assert_eq!(fleet.inventory.offline.iter().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(fleet.workers[1].since, at(4));
        assert_eq!(fleet.apply(1, up(None), at(5)), None, "its devices are not known: still down");
        assert!(!fleet.workers[1].up);

        // b comes back with its device: the same index, new figures.
        assert_eq!(fleet.apply(1, up(Some(vec![device("b:2", 0, 70)])), at(6)), Some(Change::Up));
        assert!(fleet.inventory.offline.is_empty());
        assert_eq!(fleet.inventory.gpus[1].free_bytes, 70);
        assert_eq!(fleet.inventory.gpus.len(), 4, "no new slot for the same devices");
        assert!(fleet.workers[1].last_error.is_empty());
    }

    #[test]
    fn a_worker_back_with_other_devices_gets_new_slots_and_its_old_ones_stay_offline() {
        let mut fleet = Fleet::new(local(), &[worker("a:1", None)], at(0));
        fleet.apply(0, up(Some(vec![device("a:1", 0, 10)])), at(1));
        fleet.apply(0, Outcome::Down("gone".into()), at(2));
        fleet.apply(0, up(Some(vec![device("a:1", 0, 10), device("a:1", 1, 10)])), at(3));
        assert_eq!(fleet.inventory.offline.iter().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(fleet.workers[0].devices, ["rpc:a:1#0", "rpc:a:1#1"]);
        assert_eq!(fleet.inventory.online().map(|(i, _)| i).collect::<Vec<_>>(), [0, 2, 3]);
        assert_eq!(fleet.apply(5, Outcome::Down("x".into()), at(4)), None, "no such worker");
    }
}
