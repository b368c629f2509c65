//! RPC workers' health and membership.
//!
//! Each `[[workers]]` endpoint is checked at start and every `[worker_health] interval`
//! ([`check()`]): connected to within `timeout`, and its devices listed through
//! llama-server when it comes up.  [`Fleet`] holds who is up and the inventory with the
//! up workers' devices in it; the [`Monitor`] task owns it, publishes it to the views
//! (D-Bus `Workers`, `/metrics`, `/api/ps`) through a watch channel, and sends every
//! change to the scheduler, which stops the runners of a worker that went down and plans
//! without its devices until it is back.  The scheduler asks for an early check
//! ([`Nudges`]) when a runner that used a worker dies.

mod check;
mod fleet;
mod monitor;

pub use check::{CheckSettings, check};
pub use fleet::{Change, Fleet, Outcome, WorkerStatus};
pub use monitor::{Monitor, Nudge, Nudges, first_round, log_change, nudges};

/// The views' copy of the fleet: the inventory (with the up workers' devices) and each
/// worker's health, as the monitor last published them.
#[derive(Debug, Clone)]
pub struct FleetView(tokio::sync::watch::Receiver<Fleet>);

impl FleetView {
    /// A view of what `fleet` publishes.
    #[must_use]
    pub fn new(fleet: tokio::sync::watch::Receiver<Fleet>) -> Self {
        Self(fleet)
    }

    /// A view that never changes: `fleet` for good.
    #[must_use]
    pub fn fixed(fleet: Fleet) -> Self {
        Self(tokio::sync::watch::channel(fleet).1)
    }

    /// The fleet now.
    #[must_use]
    pub fn now(&self) -> Fleet {
        self.0.borrow().clone()
    }

    /// The inventory now.
    #[must_use]
    pub fn inventory(&self) -> crate::gpu::Inventory {
        self.0.borrow().inventory.clone()
    }

    /// Resolves when the fleet changed since this view last looked (never, once the
    /// monitor is gone).
    pub async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Default for FleetView {
    fn default() -> Self {
        Self::fixed(Fleet::default())
    }
}
