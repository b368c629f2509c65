//! What keeps the daemon honest while it runs: the tasks it cannot serve without (a dead
//! one ends the process, non-zero) and the watchdog, pinged only after the scheduler answered.

use std::time::Duration;

use crate::dbus;
use crate::scheduler::handle::Handle;
use crate::systemd::Notifier;

/// The background tasks the daemon cannot serve without: the scheduler (and the D-Bus
/// follower, held by the bus service).
#[derive(Debug)]
pub(super) struct Vital {
    pub(super) scheduler: tokio::task::JoinHandle<()>,
}

impl Vital {
    /// Resolves once the scheduler or the D-Bus follower ended (they run until the daemon
    /// stops them, after this loop); logs which one and why, at error level, and returns
    /// it as the daemon's failure.
    pub(super) async fn died(
        &mut self,
        follower: impl Future<Output = Result<(), tokio::task::JoinError>>,
    ) -> anyhow::Error {
        let (task, result) = tokio::select! {
            result = &mut self.scheduler => ("scheduler", result),
            result = follower => ("D-Bus follower", result),
        };
        task_died(task, result)
    }
}

/// The D-Bus follower's end, or never without D-Bus.
pub(super) async fn follower(bus: Option<&mut dbus::Service>) -> Result<(), tokio::task::JoinError> {
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
pub(super) async fn watchdog_ping(notifier: &Notifier, scheduler: &Handle, within: Duration) -> bool {
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

/// Waits for the next watchdog tick, or forever when there is no watchdog.
pub(super) async fn tick(interval: Option<&mut tokio::time::Interval>) {
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

    use super::{Vital, watchdog_ping};
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
}
