//! The scheduler task with a fake backend under tokio's paused clock: loads joined,
//! keep-alive expiry, eviction order, queue limits, failures, crashes, and each of
//! Ollama's scheduler races shown absent.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use super::actor::Scheduler;
use super::backend::{Backend, BoxFuture, LiveRunner, StartRequest};
use super::failure::{FailureClass, LoadFailure};
use super::footprints::Footprints;
use super::handle::Handle;
use super::keep_alive::{Clamp, KeepAlive};
use super::key::{RunnerKey, Weights};
use super::policy::{Footprint, GpuView};
use super::types::{Limits, ModelRequest, ScheduleError};
use crate::store::digest::Digest;
use crate::supervisor::command::{LoadOptions, ModelFiles};

const MIB: u64 = 1 << 20;

/// What the fake backend was asked to do, in order.
#[derive(Default)]
struct Journal {
    lines: Vec<String>,
    crash: BTreeMap<u64, oneshot::Sender<String>>,
}

#[derive(Clone, Default)]
struct Fake {
    journal: Arc<Mutex<Journal>>,
    /// Models whose loads fail.
    failing: Arc<Mutex<Vec<String>>>,
}

impl Fake {
    fn lines(&self) -> Vec<String> {
        self.journal.lock().expect("lock").lines.clone()
    }

    fn crash(&self, runner: u64) {
        let sender = self.journal.lock().expect("lock").crash.remove(&runner).expect("a live runner");
        let _ = sender.send("killed by signal 9".into());
    }
}

struct FakeRunner {
    id: u64,
    journal: Arc<Mutex<Journal>>,
    crashed: Option<oneshot::Receiver<String>>,
}

impl Backend for Fake {
    fn start(&self, request: StartRequest) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, LoadFailure>> {
        let journal = Arc::clone(&self.journal);
        let fails = self.failing.lock().expect("lock").contains(&request.model);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut j = journal.lock().expect("lock");
            j.lines.push(format!("start {} {}", request.id, request.model));
            if fails {
                return Err(LoadFailure::new(FailureClass::BadModel, "bad model file"));
            }
            let (tx, rx) = oneshot::channel();
            j.crash.insert(request.id, tx);
            drop(j);
            Ok(Box::new(FakeRunner { id: request.id, journal, crashed: Some(rx) }) as Box<dyn LiveRunner>)
        })
    }
}

impl LiveRunner for FakeRunner {
    fn socket(&self) -> PathBuf {
        PathBuf::from(format!("/run/corral/runner-{}.sock", self.id))
    }

    fn measured(&self) -> Option<Footprint> {
        None
    }

    fn pid(&self) -> u32 {
        1000 + u32::try_from(self.id).expect("small")
    }

    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.journal.lock().expect("lock").lines.push(format!("stop {}", self.id));
        })
    }

    fn kill(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.journal.lock().expect("lock").lines.push(format!("kill {}", self.id));
        })
    }

    fn exited(&mut self) -> BoxFuture<'_, String> {
        Box::pin(async move {
            // A dropped trigger means "never crashes".
            match self.crashed.take() {
                Some(rx) => match rx.await {
                    Ok(reason) => reason,
                    Err(_) => std::future::pending().await,
                },
                None => std::future::pending().await,
            }
        })
    }
}

fn limits() -> Limits {
    Limits {
        max_loaded: 3,
        max_queue: 8,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        clamp: Clamp::default(),
        partial_offload: true,
    }
}

/// A scheduler on a CPU-only host with `host_mib` of memory for models.
fn scheduler(host_mib: u64, limits: Limits) -> (Fake, Handle) {
    let fake = Fake::default();
    let (scheduler, handle) =
        Scheduler::new(Arc::new(fake.clone()), Vec::<GpuView>::new(), host_mib * MIB, limits, Footprints::in_memory());
    tokio::spawn(scheduler.run());
    (fake, handle)
}

/// The key of `name`'s weights with the default load options.
fn key(name: &str) -> RunnerKey {
    RunnerKey::new(Weights::of(Digest::of(name.as_bytes())), &LoadOptions::default())
}

fn model(name: &str, mib: u64) -> ModelRequest {
    ModelRequest {
        key: key(name),
        name: name.to_owned(),
        files: ModelFiles { model: PathBuf::from(format!("/blobs/{name}")), projector: None, adapters: Vec::new() },
        options: LoadOptions::default(),
        need: Footprint { vram: mib * MIB, ram: 0 },
        layers: 0,
        keep_alive: None,
        pinned: false,
    }
}

fn with_keep_alive(mut request: ModelRequest, keep_alive: KeepAlive) -> ModelRequest {
    request.keep_alive = Some(keep_alive);
    request
}

/// Returns once a load is under way (the fake's take 100 ms of the paused clock, which
/// does not move while this yields).
async fn under_way(handle: &Handle) {
    while handle.loaded().await.expect("loaded").is_empty() {
        tokio::task::yield_now().await;
    }
}

/// Lets the scheduler and its tasks run until nothing is ready (the clock is paused).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_for_one_model_share_one_load() {
    let (fake, handle) = scheduler(1024, limits());
    let (a, b) = tokio::join!(handle.acquire(model("m", 100)), handle.acquire(model("m", 100)));
    let (a, b) = (a.expect("a"), b.expect("b"));
    assert_eq!(a.socket(), b.socket());
    assert_eq!(fake.lines(), ["start 1 m"], "one load for both");
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!((loaded.len(), loaded[0].leases, loaded[0].state), (1, 2, "ready"));
}

#[tokio::test(start_paused = true)]
async fn keep_alive_expires_idle_runners_and_zero_unloads_at_once() {
    let (fake, handle) = scheduler(1024, limits());
    drop(handle.acquire(model("default", 100)).await.expect("lease"));
    drop(handle.acquire(with_keep_alive(model("zero", 100), KeepAlive::For(Duration::ZERO))).await.expect("lease"));
    drop(handle.acquire(with_keep_alive(model("forever", 100), KeepAlive::Forever)).await.expect("lease"));
    settle().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        fake.lines().iter().filter(|l| l.starts_with("stop")).count(),
        1,
        "only keep_alive 0 unloaded: {:?}",
        fake.lines()
    );
    tokio::time::sleep(Duration::from_secs(299)).await;
    assert!(!fake.lines().contains(&"stop 1".to_owned()), "not before 5 minutes");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(fake.lines().contains(&"stop 1".to_owned()), "after 5 minutes: {:?}", fake.lines());
    tokio::time::sleep(Duration::from_secs(100_000)).await;
    let left: Vec<String> = handle.loaded().await.expect("loaded").into_iter().map(|m| m.name).collect();
    assert_eq!(left, ["forever"]);
}

#[tokio::test(start_paused = true)]
async fn an_unset_keep_alive_keeps_the_runners_and_a_new_one_replaces_it() {
    let (_fake, handle) = scheduler(1024, limits());
    drop(
        handle
            .acquire(with_keep_alive(model("m", 100), KeepAlive::For(Duration::from_secs(3600))))
            .await
            .expect("lease"),
    );
    drop(handle.acquire(model("m", 100)).await.expect("lease"));
    settle().await;
    assert_eq!(handle.loaded().await.expect("loaded")[0].keep_alive, KeepAlive::For(Duration::from_secs(3600)));
    drop(
        handle.acquire(with_keep_alive(model("m", 100), KeepAlive::For(Duration::from_secs(60)))).await.expect("lease"),
    );
    settle().await;
    assert_eq!(handle.loaded().await.expect("loaded")[0].keep_alive, KeepAlive::For(Duration::from_secs(60)));
}

#[tokio::test(start_paused = true)]
async fn an_idle_runner_is_evicted_for_a_model_that_does_not_fit() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("a", 600)).await.expect("a"));
    let b = handle.acquire(model("b", 600)).await.expect("b loads after a is gone");
    assert_eq!(fake.lines(), ["start 1 a", "stop 1", "start 2 b"]);
    drop(b);
}

#[tokio::test(start_paused = true)]
async fn a_busy_victim_drains_takes_no_new_requests_and_the_queue_is_served() {
    let (fake, handle) = scheduler(1000, limits());
    let lease_a = handle.acquire(model("a", 600)).await.expect("a");
    let waiting_b = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("b", 600)).await }
    });
    settle().await;
    assert_eq!(handle.loaded().await.expect("loaded")[0].name, "a");
    // A new request for the draining model does not get it: it waits behind b.
    let waiting_a = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("a", 600)).await }
    });
    settle().await;
    assert!(!waiting_b.is_finished() && !waiting_a.is_finished());
    drop(lease_a);
    let b = waiting_b.await.expect("join").expect("b");
    assert_eq!(fake.lines(), ["start 1 a", "stop 1", "start 2 b"]);
    drop(b);
    // b's default keep-alive keeps it; a's request waits for room until b expires.
    tokio::time::sleep(Duration::from_secs(301)).await;
    waiting_a.await.expect("join").expect("a again");
    assert_eq!(fake.lines(), ["start 1 a", "stop 1", "start 2 b", "stop 2", "start 3 a"]);
}

#[tokio::test(start_paused = true)]
async fn the_queue_is_bounded_and_a_full_queue_answers_at_once() {
    let (_fake, handle) = scheduler(1000, Limits { max_queue: 1, ..limits() });
    let first = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("a", 100)).await }
    });
    tokio::task::yield_now().await;
    let err = handle.acquire(model("b", 100)).await.expect_err("full");
    assert_eq!(err, ScheduleError::QueueFull(1));
    assert!(err.to_string().contains("server busy"));
    first.await.expect("join").expect("the queued one still loads");
    // A zero-size queue refuses loads at once instead of hanging.
    let (_fake, zero) = scheduler(1000, Limits { max_queue: 0, ..limits() });
    assert_eq!(zero.acquire(model("a", 100)).await.expect_err("zero"), ScheduleError::QueueFull(0));
}

#[tokio::test(start_paused = true)]
async fn a_model_that_cannot_fit_is_refused_with_the_numbers() {
    let (_fake, handle) = scheduler(1000, limits());
    let err = handle.acquire(model("huge", 2000)).await.expect_err("no fit");
    assert_eq!(
        err,
        ScheduleError::InsufficientMemory {
            model: "huge".into(),
            needed: 2000 * MIB,
            available: 1000 * MIB,
            devices: vec![],
            host: 1000 * MIB,
            down: vec![],
        }
    );
    // In binary units, as people read them; the raw numbers stay in the error's fields.
    assert_eq!(
        err.to_string(),
        "model 'huge' needs 2.0 GiB of memory, but at most 1000.0 MiB can be made available (host memory: 1000.0 MiB)"
    );
}

#[tokio::test(start_paused = true)]
async fn pinned_models_are_never_evicted() {
    let (_fake, handle) = scheduler(1000, limits());
    let mut pinned = model("pinned", 600);
    pinned.pinned = true;
    drop(handle.acquire(pinned).await.expect("pinned"));
    let err = handle.acquire(model("other", 600)).await.expect_err("no room");
    assert!(matches!(err, ScheduleError::InsufficientMemory { available, .. } if available == 400 * MIB), "{err}");
    tokio::time::sleep(Duration::from_secs(100_000)).await;
    assert_eq!(handle.loaded().await.expect("loaded").len(), 1, "a pinned model does not expire either");
}

#[tokio::test(start_paused = true)]
async fn max_loaded_models_is_never_exceeded() {
    let (fake, handle) = scheduler(100_000, Limits { max_loaded: 2, ..limits() });
    for name in ["a", "b", "c", "d"] {
        drop(handle.acquire(model(name, 10)).await.expect(name));
        assert!(handle.loaded().await.expect("loaded").len() <= 2);
    }
    assert_eq!(fake.lines(), ["start 1 a", "start 2 b", "stop 1", "start 3 c", "stop 2", "start 4 d"]);
}

#[tokio::test(start_paused = true)]
async fn failed_loads_reach_every_waiter_and_repeated_failures_back_off() {
    let (fake, handle) = scheduler(1000, limits());
    fake.failing.lock().expect("lock").push("bad".into());
    let (a, b) = tokio::join!(handle.acquire(model("bad", 100)), handle.acquire(model("bad", 100)));
    for result in [a, b] {
        assert_eq!(
            result.expect_err("fails"),
            ScheduleError::LoadFailed {
                model: "bad".into(),
                class: FailureClass::BadModel,
                reason: "bad model file".into()
            }
        );
    }
    // The first failure is retried at once; the second backs off and says why.
    handle.acquire(model("bad", 100)).await.expect_err("second failure");
    let err = handle.acquire(model("bad", 100)).await.expect_err("backing off");
    assert!(matches!(err, ScheduleError::BackingOff { failures: 2, .. }), "{err}");
    assert!(err.to_string().contains("bad model file"));
    assert_eq!(fake.lines().len(), 2, "no load while backing off");
    fake.failing.lock().expect("lock").clear();
    tokio::time::sleep(Duration::from_secs(5)).await;
    handle.acquire(model("bad", 100)).await.expect("loads once fixed and the backoff is over");
}

#[tokio::test(start_paused = true)]
async fn a_crashed_runner_is_dropped_and_the_next_request_loads_it_again() {
    let (fake, handle) = scheduler(1000, limits());
    let lease = handle.acquire(model("m", 100)).await.expect("m");
    fake.crash(1);
    settle().await;
    assert!(handle.loaded().await.expect("loaded").is_empty());
    // The stale lease's release finds no runner: no count goes wrong (Ollama could underflow).
    let fresh = handle.acquire(model("m", 100)).await.expect("loaded again");
    drop(lease);
    settle().await;
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!((loaded[0].id, loaded[0].leases), (2, 1), "the new runner's lease count is untouched");
    drop(fresh);
}

#[tokio::test(start_paused = true)]
async fn unload_replies_once_the_child_is_reaped_and_waits_for_busy_runners() {
    let (fake, handle) = scheduler(1000, limits());
    let lease = handle.acquire(model("m", 100)).await.expect("m");
    let unload = tokio::spawn({
        let handle = handle.clone();
        async move { handle.unload(&key("m")).await }
    });
    settle().await;
    assert!(!unload.is_finished(), "a busy runner unloads when its request ends");
    drop(lease);
    tokio::task::yield_now().await;
    // Read while it unloads: a consistent view from the owner, never a half-removed runner.
    let during = handle.loaded().await.expect("loaded");
    assert_eq!(during.len(), 1);
    assert_eq!((during[0].state, during[0].pid), ("unloading", None), "{during:?}");
    unload.await.expect("join").expect("unloaded");
    assert_eq!(fake.lines(), ["start 1 m", "stop 1"], "the reply came after the stop");
    assert_eq!(handle.unload(&key("m")).await.expect_err("gone"), ScheduleError::NotLoaded(key("m").to_string()));
}

#[tokio::test(start_paused = true)]
async fn a_request_that_reuses_a_runner_about_to_expire_keeps_it() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("m", 100)).await.expect("m"));
    tokio::time::sleep(Duration::from_secs(299)).await;
    let lease = handle.acquire(model("m", 100)).await.expect("reused just before expiry");
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(fake.lines(), ["start 1 m"], "no unload while held, though the old deadline passed");
    drop(lease);
    tokio::time::sleep(Duration::from_secs(299)).await;
    assert_eq!(fake.lines(), ["start 1 m"], "the keep-alive restarts from the release");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(fake.lines(), ["start 1 m", "stop 1"]);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_goes_away_while_queued_drives_no_eviction() {
    let (fake, handle) = scheduler(1000, limits());
    let lease_a = handle.acquire(model("a", 600)).await.expect("a");
    let gone = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("b", 600)).await }
    });
    settle().await;
    gone.abort();
    let _ = gone.await;
    drop(lease_a);
    settle().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // a drains because b asked while a was busy; b's client is gone, so nothing loads b.
    assert!(!fake.lines().iter().any(|l| l.ends_with(" b")), "{:?}", fake.lines());
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_every_runner_and_answers_waiters() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("a", 100)).await.expect("a"));
    drop(handle.acquire(model("b", 100)).await.expect("b"));
    handle.shutdown().await;
    let mut lines = fake.lines();
    lines.sort();
    assert_eq!(lines, ["start 1 a", "start 2 b", "stop 1", "stop 2"]);
    assert_eq!(handle.acquire(model("a", 100)).await.expect_err("stopped"), ScheduleError::ShuttingDown);
}

#[tokio::test(start_paused = true)]
async fn changed_load_options_reload_and_sampling_options_do_not() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("m", 100)).await.expect("m"));
    let mut bigger = model("m", 200);
    bigger.key.num_ctx = 8192;
    let lease = handle.acquire(bigger.clone()).await.expect("reloaded");
    assert_eq!(fake.lines(), ["start 1 m", "stop 1", "start 2 m"], "the old runner went first");
    // A request with the same load options (only sampling differs) shares the runner.
    let again = handle.acquire(bigger).await.expect("shared");
    assert_eq!(again.runner(), lease.runner());
    // While the new runner is busy, a request for the old options waits for it to drain.
    let old = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("m", 100)).await }
    });
    settle().await;
    assert!(!old.is_finished());
    drop((lease, again));
    old.await.expect("join").expect("old options again");
    assert_eq!(fake.lines(), ["start 1 m", "stop 1", "start 2 m", "stop 2", "start 3 m"]);
}

#[tokio::test(start_paused = true)]
async fn queued_requests_for_a_model_join_its_load_in_order() {
    let (fake, handle) = scheduler(1000, limits());
    let lease_a = handle.acquire(model("a", 600)).await.expect("a");
    let spawn = |name: &'static str| {
        let handle = handle.clone();
        tokio::spawn(async move { handle.acquire(model(name, 600)).await })
    };
    // b waits for a to drain, c waits behind b for room, and a second b behind c must join
    // b's load rather than wait for c (which would load b a second time after c).
    let b1 = spawn("b");
    settle().await;
    let c = spawn("c");
    settle().await;
    let b2 = spawn("b");
    settle().await;
    drop(lease_a);
    let (b1, b2) = (b1.await.expect("join").expect("b1"), b2.await.expect("join").expect("b2"));
    assert_eq!(b1.runner(), b2.runner());
    assert!(!c.is_finished(), "c waits for room");
    drop((b1, b2));
    tokio::time::sleep(Duration::from_secs(301)).await;
    c.await.expect("join").expect("c");
    assert_eq!(fake.lines(), ["start 1 a", "stop 1", "start 2 b", "stop 2", "start 3 c"], "b loaded once");
}

#[tokio::test(start_paused = true)]
async fn new_limits_apply_to_what_waits() {
    let (fake, handle) = scheduler(100_000, Limits { max_loaded: 1, ..limits() });
    let a = handle.acquire(model("a", 10)).await.expect("a");
    let b = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("b", 10)).await }
    });
    settle().await;
    assert!(!b.is_finished(), "one model at a time, and a is busy");
    handle.reconfigure(Limits { max_loaded: 2, ..limits() }).await;
    let b = b.await.expect("join").expect("b loads next to a once the limit allows");
    assert_eq!(handle.loaded().await.expect("loaded").len(), 2);
    assert_eq!(fake.lines(), ["start 1 a", "start 2 b"]);
    drop((a, b));
}

#[tokio::test(start_paused = true)]
async fn a_lower_limit_unloads_idle_runners_at_once_and_drains_busy_ones() {
    let (fake, handle) = scheduler(100_000, limits());
    drop(handle.acquire(model("a", 10)).await.expect("a"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(handle.acquire(model("b", 10)).await.expect("b"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let busy = handle.acquire(model("c", 10)).await.expect("c");
    settle().await;
    handle.reconfigure(Limits { max_loaded: 1, ..limits() }).await;
    settle().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Long before any keep-alive ran out: the two idle ones went, least recently used first.
    let names: Vec<String> = handle.loaded().await.expect("loaded").into_iter().map(|m| m.name).collect();
    assert_eq!(names, ["c"], "{:?}", fake.lines());
    assert_eq!(fake.lines(), ["start 1 a", "start 2 b", "start 3 c", "stop 1", "stop 2"]);
    handle.reconfigure(Limits { max_loaded: 0, ..limits() }).await;
    settle().await;
    // Zero means one here as in decisions (at least one runner); lower limits on a busy
    // runner drain it instead.
    assert_eq!(handle.loaded().await.expect("loaded").len(), 1);
    drop(busy);
}

#[tokio::test(start_paused = true)]
async fn a_lower_limit_drains_a_busy_runner_which_goes_when_its_request_ends() {
    let (fake, handle) = scheduler(100_000, limits());
    let a = handle.acquire(model("a", 10)).await.expect("a");
    let b = handle.acquire(model("b", 10)).await.expect("b");
    handle.reconfigure(Limits { max_loaded: 1, ..limits() }).await;
    settle().await;
    assert_eq!(handle.loaded().await.expect("loaded").len(), 2, "both busy: nothing stops mid-request");
    // The drained one takes no new request: a request for it waits for room.
    let again = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("a", 10)).await }
    });
    settle().await;
    assert!(!again.is_finished());
    drop(a);
    settle().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fake.lines(), ["start 1 a", "start 2 b", "stop 1"], "a went once its request ended");
    drop(b);
    tokio::time::sleep(Duration::from_secs(301)).await;
    drop(again.await.expect("join").expect("a loads again once b expired"));
}

#[tokio::test(start_paused = true)]
async fn a_runner_reported_dead_is_replaced_by_a_fresh_load_for_the_next_request() {
    let (fake, handle) = scheduler(1000, Limits { max_loaded: 1, ..limits() });
    let lease = handle.acquire(model("m", 100)).await.expect("m");
    // Its process died but its crash report has not come (the fake never reports one).
    handle.report_dead(lease).await;
    let fresh = handle.acquire(model("m", 100)).await.expect("a fresh load");
    assert_eq!(fresh.runner(), 2, "not the dead runner");
    assert_eq!(fake.lines(), ["start 1 m", "stop 1", "start 2 m"]);
    // A report about a runner that is gone already changes nothing.
    let again = handle.acquire(model("m", 100)).await.expect("m");
    assert_eq!(again.runner(), 2);
    drop(fresh);
    handle.ping().await.expect("the scheduler answers");
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!((loaded.len(), loaded[0].id, loaded[0].leases), (1, 2, 1));
    drop(again);
}

#[tokio::test(start_paused = true)]
async fn a_draining_runner_beside_its_replacement_gives_unique_metric_series() {
    let (_fake, handle) = scheduler(100_000, limits());
    let old = handle.acquire(model("m", 10)).await.expect("m");
    // The same weights with other load options: the old runner drains beside the new one.
    let mut other = model("m", 10);
    other.key.num_batch = Some(7);
    let new = handle.acquire(other).await.expect("the replacement");
    let stats = handle.stats().await.expect("stats");
    assert_eq!(stats.loaded.len(), 2, "{:?}", stats.loaded);
    assert!(stats.loaded.iter().all(|m| m.name == "m" && m.state == "ready"), "{:?}", stats.loaded);
    let text = crate::http::metrics::render(&stats);
    let mut seen = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let series = line.rsplit_once(' ').expect("a value").0;
        assert!(seen.insert(series.to_owned()), "{series} twice in\n{text}");
    }
    drop((old, new));
}

/// `name`'s request for the same weights and load options as `model(of, …)`: another
/// model name (a copy, or a Modelfile over the same weights).
fn same_as(of: &str, name: &str, mib: u64) -> ModelRequest {
    let mut request = model(of, mib);
    request.name = name.to_owned();
    request
}

#[tokio::test(start_paused = true)]
async fn models_with_the_same_weights_and_options_share_a_runner_and_each_shows_loaded() {
    let (fake, handle) = scheduler(1000, limits());
    let mut notices = handle.subscribe();
    let tiny = handle.acquire(model("tiny", 100)).await.expect("tiny");
    let tiny2 = handle.acquire(same_as("tiny", "tiny2", 100)).await.expect("tiny2");
    assert_eq!(tiny2.runner(), tiny.runner(), "one runner");
    assert_eq!(fake.lines(), ["start 1 tiny"], "no second load");
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].names, ["tiny", "tiny2"], "both models are served");
    // The views are told who joined.
    let mut serving = None;
    while let Ok(notice) = notices.try_recv() {
        if let super::types::Notice::Serving { runner, names } = notice {
            serving = Some((runner, names));
        }
    }
    assert_eq!(serving, Some((tiny.runner(), vec!["tiny".to_owned(), "tiny2".to_owned()])));
    // Unloading either stops the one process, for both.
    drop((tiny, tiny2));
    handle.unload_model("tiny2").await.expect("unload");
    assert!(handle.loaded().await.expect("loaded").is_empty());
    assert_eq!(fake.lines(), ["start 1 tiny", "stop 1"]);
    assert_eq!(handle.unload_model("tiny2").await.expect_err("gone"), ScheduleError::NotLoaded("tiny2".into()));
}

#[tokio::test(start_paused = true)]
async fn a_shared_load_under_way_is_joined_by_another_model() {
    let (fake, handle) = scheduler(1000, limits());
    let (a, b) = tokio::join!(handle.acquire(model("tiny", 100)), handle.acquire(same_as("tiny", "tiny2", 100)));
    assert_eq!(a.expect("tiny").runner(), b.expect("tiny2").runner());
    assert_eq!(fake.lines(), ["start 1 tiny"]);
    assert_eq!(handle.loaded().await.expect("loaded")[0].names, ["tiny", "tiny2"]);
}

/// One runner serves at most `MAX_NAMES_PER_RUNNER` models: the next model of the same
/// weights and options is refused, naming the limit and what to do, while the runner's
/// models keep being served; whether the runner is loading or ready.
#[tokio::test(start_paused = true)]
async fn a_runner_serves_at_most_its_number_of_models() {
    use super::actor::MAX_NAMES_PER_RUNNER;
    let (fake, handle) = scheduler(1000, Limits { max_queue: 512, ..limits() });
    // All at once, while the load is under way.
    let requests = (0..=MAX_NAMES_PER_RUNNER).map(|i| handle.acquire(same_as("tiny", &format!("tiny{i}"), 100)));
    let results = futures_util::future::join_all(requests).await;
    let refused: Vec<&ScheduleError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    let message = refused[0].to_string();
    assert!(
        message.starts_with(&format!(
            "model 'tiny{MAX_NAMES_PER_RUNNER}' would share the runner that already serves {MAX_NAMES_PER_RUNNER} models"
        )),
        "{message}"
    );
    assert!(message.contains("(tiny0, …)") && message.ends_with("use one of their names, or stop one of them"));
    assert_eq!(fake.lines(), ["start 1 tiny0"]);
    drop(results);
    // Once ready: one more name is refused, the names it serves are served.
    let error = handle.acquire(same_as("tiny", "another", 100)).await.expect_err("one too many");
    assert!(matches!(error, ScheduleError::TooManyNames { limit: MAX_NAMES_PER_RUNNER, .. }), "{error:?}");
    drop(handle.acquire(same_as("tiny", "tiny3", 100)).await.expect("a name it serves"));
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].names.len(), MAX_NAMES_PER_RUNNER);
    handle.unload_model("tiny3").await.expect("unload");
    assert_eq!(fake.lines(), ["start 1 tiny0", "stop 1"], "unloading one model stops the shared runner");
}

#[tokio::test(start_paused = true)]
async fn other_options_for_another_model_never_replace_a_runner_it_does_not_own() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("tiny", 100)).await.expect("tiny"));
    // tiny2: the same weights with another context: a runner of its own, tiny's stays.
    let mut tiny2 = same_as("tiny", "tiny2", 100);
    tiny2.key.num_ctx = 8192;
    drop(handle.acquire(tiny2.clone()).await.expect("tiny2"));
    assert_eq!(fake.lines(), ["start 1 tiny", "start 2 tiny2"], "nothing stopped");
    let loaded = handle.loaded().await.expect("loaded");
    let names: Vec<&[String]> = loaded.iter().map(|m| m.names.as_slice()).collect();
    assert_eq!(names, [["tiny".to_owned()], ["tiny2".to_owned()]]);

    // tiny2 shared tiny's runner, then asks with other options: it moves to its own
    // runner and tiny's stays, serving tiny alone.
    handle.unload_model("tiny2").await.expect("unload tiny2");
    drop(handle.acquire(same_as("tiny", "tiny2", 100)).await.expect("tiny2 shares"));
    assert_eq!(handle.loaded().await.expect("loaded")[0].names, ["tiny", "tiny2"]);
    drop(handle.acquire(tiny2).await.expect("tiny2 with other options"));
    let loaded = handle.loaded().await.expect("loaded");
    let names: Vec<(u64, &[String])> = loaded.iter().map(|m| (m.id, m.names.as_slice())).collect();
    assert_eq!(names, [(1, &["tiny".to_owned()][..]), (3, &["tiny2".to_owned()][..])]);
    assert_eq!(fake.lines(), ["start 1 tiny", "start 2 tiny2", "stop 2", "start 3 tiny2"]);

    // The model alone on its runner with other options is reloaded, as before.
    let mut tiny_big = model("tiny", 100);
    tiny_big.key.num_ctx = 2048;
    drop(handle.acquire(tiny_big).await.expect("tiny reloaded"));
    assert_eq!(fake.lines()[4..], ["stop 1", "start 4 tiny"]);
}

/// Ollama's deadlock (ollama/ollama#17408): a request for a model that is being evicted
/// revived it mid-eviction while the model that evicted it waited for its memory. Here a
/// request for a model on its way out waits for it to be gone, then loads it afresh (making
/// room again by the usual rules), and every request is served.
#[tokio::test(start_paused = true)]
async fn a_model_being_evicted_is_not_revived_mid_eviction() {
    let (fake, handle) = scheduler(1000, limits());
    drop(handle.acquire(model("a", 700)).await.expect("a"));
    let mut notices = handle.subscribe();
    // b evicts a; while a stops (50 ms), a is asked for again.
    let b = handle.acquire(model("b", 700));
    let again = async {
        loop {
            if let Ok(super::types::Notice::Unloading { .. }) = notices.recv().await {
                break;
            }
        }
        handle.acquire(model("a", 700)).await
    };
    let (b, again) = tokio::join!(
        async {
            let lease = b.await.expect("b");
            // b is used and released, so a may evict it in turn.
            drop(lease);
        },
        again
    );
    let () = b;
    let again = again.expect("a again");
    assert_eq!(fake.lines(), ["start 1 a", "stop 1", "start 2 b", "stop 2", "start 3 a"]);
    assert_eq!(again.runner(), 3, "a fresh runner, not the one being stopped");
}

#[tokio::test(start_paused = true)]
async fn a_model_too_big_for_any_device_is_refused_at_once_naming_each_device() {
    let fake = Fake::default();
    let gpus = vec![
        GpuView { index: 0, name: "RPC0".into(), worker: None, usable: 300 * MIB },
        GpuView { index: 1, name: "RPC1".into(), worker: None, usable: 200 * MIB },
    ];
    let no_partial = Limits { partial_offload: false, ..limits() };
    let (scheduler, handle) =
        Scheduler::new(Arc::new(fake.clone()), gpus, 400 * MIB, no_partial, Footprints::in_memory());
    tokio::spawn(scheduler.run());
    let mut big = model("big", 600);
    big.layers = 10;
    let err = handle.acquire(big).await.expect_err("no fit");
    assert!(
        err.to_string().ends_with("(RPC0: 300.0 MiB, RPC1: 200.0 MiB; host memory: 400.0 MiB)"),
        "each device's room is named: {err}"
    );
    assert!(fake.lines().is_empty(), "nothing was started");
}

/// Unloading a model is one message: the scheduler takes every runner serving it out of
/// service in one step. (Two steps, a list of runner keys and then an unload by each key,
/// stopped the first runner with the key twice, here the draining one, and left its
/// replacement running.)
#[tokio::test(start_paused = true)]
async fn unloading_a_model_stops_each_of_its_runners_a_draining_one_and_its_replacement() {
    let (fake, handle) = scheduler(1000, limits());
    let dead = handle.acquire(model("m", 100)).await.expect("m");
    let held = handle.acquire(model("m", 100)).await.expect("m, a second request");
    // Reported dead while another request holds it: it drains, and a replacement loads.
    handle.report_dead(dead).await;
    drop(handle.acquire(model("m", 100)).await.expect("a fresh load"));
    let loaded = handle.loaded().await.expect("loaded");
    let runners: Vec<(u64, &str)> = loaded.iter().map(|m| (m.id, m.state)).collect();
    assert_eq!(runners, [(1, "ready"), (2, "ready")], "the draining runner beside its replacement");

    let unload = tokio::spawn({
        let handle = handle.clone();
        async move { handle.unload_model("m").await }
    });
    // The idle replacement stops at once; the draining runner once its request ends.
    let mut notices = handle.subscribe();
    while handle.loaded().await.expect("loaded").iter().any(|m| m.id == 2) {
        tokio::time::timeout(Duration::from_secs(10), notices.recv()).await.expect("a notice").expect("open");
    }
    assert!(!unload.is_finished(), "the busy runner is not reaped yet");
    drop(held);
    unload.await.expect("join").expect("unloaded");
    assert!(handle.loaded().await.expect("loaded").is_empty(), "no runner of m is left");
    assert_eq!(fake.lines(), ["start 1 m", "start 2 m", "stop 2", "stop 1"]);
}

/// Asked to unload while it loads, a model whose load then fails is unloaded: the
/// unload answers success (nothing is left), not "shutting down".
#[tokio::test(start_paused = true)]
async fn an_unload_during_a_load_that_fails_succeeds() {
    let (fake, handle) = scheduler(1000, limits());
    fake.failing.lock().expect("lock").push("bad".into());
    let load = handle.acquire(model("bad", 100));
    let unload = async {
        // The load is under way (the fake takes 100 ms) when the unload comes.
        under_way(&handle).await;
        handle.unload_model("bad").await
    };
    let (load, unload) = tokio::join!(load, unload);
    assert!(matches!(load, Err(ScheduleError::LoadFailed { .. })), "{load:?}");
    assert_eq!(unload, Ok(()));
    assert!(handle.loaded().await.expect("loaded").is_empty());
}

/// A worker `w` at 10.0.0.2:1 with one device of 1000 MiB, up or down (`why`).
fn fleet(down: Option<&str>) -> crate::workers::Fleet {
    use crate::workers::{Fleet, Outcome};
    let worker = crate::config::WorkerConfig {
        address: "10.0.0.2:1".parse().expect("address"),
        name: Some("w".into()),
        memory: None,
        allow_public: false,
    };
    let device = crate::gpu::Gpu {
        index: 0,
        id: "rpc:10.0.0.2:1#0".into(),
        name: "w".into(),
        backend: crate::gpu::Backend::Rpc,
        total_bytes: 1000 * MIB,
        free_bytes: 1000 * MIB,
        driver: None,
        compute: None,
        endpoint: Some("10.0.0.2:1".into()),
    };
    let mut fleet = Fleet::new(crate::gpu::Inventory::default(), &[worker], std::time::UNIX_EPOCH);
    fleet.apply(0, Outcome::Up { rtt: Duration::from_millis(1), devices: Some(vec![device]) }, std::time::UNIX_EPOCH);
    if let Some(why) = down {
        fleet.apply(0, Outcome::Down(why.into()), std::time::UNIX_EPOCH);
    }
    fleet
}

/// A scheduler with 100 MiB of host memory and the worker of [`fleet`], up; and where it
/// asks for early checks.
fn scheduler_with_worker() -> (Fake, Handle, crate::workers::Nudges) {
    let fake = Fake::default();
    let gpus = vec![GpuView { index: 0, name: "w".into(), worker: Some("10.0.0.2:1".into()), usable: 1000 * MIB }];
    let (scheduler, handle) =
        Scheduler::new(Arc::new(fake.clone()), gpus, 100 * MIB, limits(), Footprints::in_memory());
    let (nudge, nudges) = crate::workers::nudges();
    tokio::spawn(scheduler.with_workers(&fleet(None), nudge).run());
    (fake, handle, nudges)
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_goes_down_has_its_runners_killed_and_is_named_to_their_requests() {
    let (fake, handle, _nudges) = scheduler_with_worker();
    let lease = handle.acquire(model("m", 500)).await.expect("loaded on the worker");
    let loaded = handle.loaded().await.expect("loaded");
    assert_eq!(loaded[0].placement, super::policy::Placement::Gpu(0));
    let runner = lease.runner();

    handle.fleet_changed(fleet(Some("cannot connect: refused")), vec!["10.0.0.2:1".into()]).await.expect("sent");
    // The request in flight still holds its lease: the runner is killed anyway, at once.
    drop(lease);
    let ended = handle.fate(runner).await.expect("a fate");
    assert_eq!(ended, "worker w (10.0.0.2:1) is down: cannot connect: refused");
    assert!(fake.lines().contains(&"kill 1".to_owned()), "killed, not stopped: {:?}", fake.lines());
    assert!(handle.loaded().await.expect("loaded").is_empty());

    // Without the worker the model fits nowhere: refused at once, naming the worker.
    let err = handle.acquire(model("m", 500)).await.expect_err("no room");
    assert!(err.to_string().ends_with("down, so not counted: worker w (10.0.0.2:1): cannot connect: refused"), "{err}");
    assert_eq!(handle.fate(999).await, None, "an unknown runner has no fate");

    // Back: used again.
    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    drop(handle.acquire(model("m", 500)).await.expect("on the worker again"));
    assert_eq!(handle.loaded().await.expect("loaded")[0].placement, super::policy::Placement::Gpu(0));
}

/// A load under way onto a worker that goes down is called off then, not when llama.cpp
/// gives up connecting: its request fails naming the worker, and nothing stays loaded.
#[tokio::test(start_paused = true)]
async fn a_load_onto_a_worker_that_goes_down_is_called_off_at_once_naming_it() {
    let (fake, handle, _nudges) = scheduler_with_worker();
    let asking = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("m", 500)).await.map(|lease| lease.runner()) }
    });
    // The fake takes 100 ms to load: the worker goes down while it does.
    under_way(&handle).await;
    handle.fleet_changed(fleet(Some("no route to host")), vec!["10.0.0.2:1".into()]).await.expect("sent");
    let err = asking.await.expect("joined").expect_err("called off");
    assert!(err.to_string().contains("worker w (10.0.0.2:1) is down: no route to host"), "{err}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!fake.lines().iter().any(|l| l.starts_with("start")), "the load never finished: {:?}", fake.lines());
    assert!(handle.loaded().await.expect("loaded").is_empty());

    // Back: loaded there.
    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    drop(handle.acquire(model("m", 500)).await.expect("on the worker again"));
    assert_eq!(handle.loaded().await.expect("loaded")[0].placement, super::policy::Placement::Gpu(0));
}

#[tokio::test(start_paused = true)]
async fn a_crash_on_a_worker_has_it_checked_before_it_is_planned_with_again() {
    let (fake, handle, mut nudges) = scheduler_with_worker();
    let runner = {
        let lease = handle.acquire(model("m", 500)).await.expect("loaded");
        lease.runner()
    };
    fake.crash(runner);
    assert_eq!(nudges.recv().await, Some(vec!["10.0.0.2:1".to_owned()]), "the monitor is asked to check");

    // Meanwhile a request waits for the check instead of failing for want of room.
    let waiting = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("m", 500)).await.map(|lease| lease.runner()) }
    });
    let ended = tokio::spawn({
        let handle = handle.clone();
        async move { handle.fate(runner).await }
    });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(!waiting.is_finished() && !ended.is_finished(), "both wait for the check");

    // The check finds the worker down: the request is refused naming it, the fate says both.
    handle.fleet_changed(fleet(Some("refused")), vec!["10.0.0.2:1".into()]).await.expect("sent");
    let err = waiting.await.expect("joined").expect_err("no room without the worker");
    assert!(err.to_string().contains("worker w (10.0.0.2:1): refused"), "{err}");
    assert_eq!(
        ended.await.expect("joined"),
        Some("worker w (10.0.0.2:1) is down: refused; the runner: it crashed: killed by signal 9".to_owned())
    );
}

/// A model that also fits the host does not go there while the worker it would use is
/// checked: it would stay on the CPU for its `keep_alive`.
#[tokio::test(start_paused = true)]
async fn a_load_that_would_go_on_a_worker_being_checked_waits_for_the_check() {
    let (fake, handle, mut nudges) = scheduler_with_worker();
    let runner = handle.acquire(model("m", 50)).await.expect("loaded").runner();
    assert_eq!(handle.loaded().await.expect("loaded")[0].placement, super::policy::Placement::Gpu(0));
    fake.crash(runner);
    assert!(nudges.recv().await.is_some(), "the monitor is asked to check");
    let waiting = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("m", 50)).await.map(|lease| lease.runner()) }
    });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(!waiting.is_finished(), "waits for the check rather than loading on the host");
    assert!(handle.loaded().await.expect("loaded").is_empty());

    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    let again = waiting.await.expect("joined").expect("loaded");
    assert_ne!(again, runner, "a new runner");
    assert_eq!(handle.loaded().await.expect("loaded")[0].placement, super::policy::Placement::Gpu(0));

    // Found down: the host takes it.
    let runner = handle.loaded().await.expect("loaded")[0].id;
    fake.crash(runner);
    assert!(nudges.recv().await.is_some());
    handle.fleet_changed(fleet(Some("refused")), vec!["10.0.0.2:1".into()]).await.expect("sent");
    drop(handle.acquire(model("m", 50)).await.expect("loaded on the host"));
    assert_eq!(handle.loaded().await.expect("loaded")[0].placement, super::policy::Placement::Cpu);
}

/// Nor does it evict a model from the host to make room there.
#[tokio::test(start_paused = true)]
async fn a_load_that_would_go_on_a_worker_being_checked_evicts_nothing_meanwhile() {
    let (fake, handle, mut nudges) = scheduler_with_worker();
    let placements = |loaded: Vec<super::types::LoadedModel>| {
        let mut placed: Vec<_> = loaded.into_iter().map(|m| (m.name, m.placement)).collect();
        placed.sort_by(|x, y| x.0.cmp(&y.0));
        placed
    };
    // b on the host while the worker is down, a on the worker once it is back.
    handle.fleet_changed(fleet(Some("refused")), vec!["10.0.0.2:1".into()]).await.expect("sent");
    drop(handle.acquire(model("b", 50)).await.expect("loaded"));
    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    let on_worker = handle.acquire(model("a", 50)).await.expect("loaded").runner();
    assert_eq!(
        placements(handle.loaded().await.expect("loaded")),
        [("a".to_owned(), super::policy::Placement::Gpu(0)), ("b".to_owned(), super::policy::Placement::Cpu)]
    );
    fake.crash(on_worker);
    assert!(nudges.recv().await.is_some());
    // c fits the host only without b, and the worker, once checked, at once.
    let waiting = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("c", 80)).await.map(|lease| lease.runner()) }
    });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(!waiting.is_finished(), "waits for the check");
    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    waiting.await.expect("joined").expect("loaded");
    assert_eq!(
        placements(handle.loaded().await.expect("loaded")),
        [("b".to_owned(), super::policy::Placement::Cpu), ("c".to_owned(), super::policy::Placement::Gpu(0))]
    );
    assert!(!fake.lines().iter().any(|l| l.starts_with("stop")), "nothing evicted: {:?}", fake.lines());
}

#[tokio::test(start_paused = true)]
async fn a_crash_on_a_healthy_worker_is_checked_and_the_worker_used_again() {
    let (fake, handle, mut nudges) = scheduler_with_worker();
    let runner = handle.acquire(model("m", 500)).await.expect("loaded").runner();
    fake.crash(runner);
    assert!(nudges.recv().await.is_some());
    let waiting = tokio::spawn({
        let handle = handle.clone();
        async move { handle.acquire(model("m", 500)).await.map(|lease| lease.runner()) }
    });
    handle.fleet_changed(fleet(None), vec!["10.0.0.2:1".into()]).await.expect("sent");
    let again = waiting.await.expect("joined").expect("loaded on the worker again");
    assert_ne!(again, runner);
    assert_eq!(handle.fate(runner).await, Some("it crashed: killed by signal 9".to_owned()));
}
