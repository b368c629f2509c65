//! Exit on idle when socket-activated: HTTP requests in flight counted, each check logged.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::dbus;
use crate::scheduler::types::Stats;

/// The HTTP requests seen, for the idle check.
#[derive(Debug, Clone, Default)]
pub(super) struct Requests {
    /// Requests whose response (streamed bodies included) has not finished.
    in_flight: Arc<AtomicUsize>,
    /// Requests started since the daemon started.
    started: Arc<AtomicU64>,
}

/// Counts a request as in flight until its response body is done or dropped.
pub(super) async fn count_requests(State(requests): State<Requests>, request: Request, next: Next) -> Response {
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
pub(super) struct IdleClock {
    /// Since when nothing has happened.
    since: Instant,
    /// The request count at the last check.
    started: u64,
}

impl IdleClock {
    pub(super) fn new(now: Instant) -> Self {
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
pub(super) fn idle_exit_due(
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Activity, IdleClock};

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
