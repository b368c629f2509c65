//! `corral::supervisor::runner` against `fake-llama-server`, for what the real
//! llama-server cannot be made to do on demand: hang or crash while loading, load slowly,
//! run out of memory (projector retry included), die after it is ready, ignore SIGTERM,
//! leave a grandchild behind.
//!
//! The fake's behaviour is the JSON in its model file; it appends one JSON line per start
//! to `<model>.starts` (pid, grandchild pid, command line), which is how these tests
//! count spawns and find processes. No test sleeps to synchronise: each waits for a
//! condition, under a generous deadline (the machine is shared).

use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use corral::supervisor::child_log::LogSink;
use corral::supervisor::command::{LoadOptions, ModelFiles, Placement};
use corral::supervisor::runner::{self, Exit, Failure, LoadError, Runner, RunnerSpec, SupervisorConfig};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::support::http;

/// The most any one step may take, however loaded the machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// A load timeout no load of these tests comes near, unless it is meant to.
const NO_TIMEOUT: Duration = Duration::from_secs(30);

/// The fake's error lines for a model context that does not fit (from a real transcript).
const CONTEXT_OOM: &str = "llama_init_from_model: failed to initialize the context: std::bad_alloc";

/// One fake model in a temporary directory, with the runtime directory next to it.
struct Fake {
    dir: tempfile::TempDir,
    model: PathBuf,
    projector: Option<PathBuf>,
    config: SupervisorConfig,
    /// Grandchildren to kill when the test ends, whatever happened.
    reap: Vec<Grandchild>,
}

/// A process the fake left behind, in the fake's process group (the runner's own, which
/// the supervisor kills whole).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Grandchild {
    pid: i32,
    /// The process group it was started in: the fake's pid.
    group: i32,
}

/// One start of the fake, from `<model>.starts`.
#[derive(Debug, Clone)]
struct Start {
    pid: i32,
    grandchild: Option<Grandchild>,
    bound: bool,
    args: Vec<String>,
}

impl Start {
    fn projector_offloaded(&self) -> bool {
        self.args.iter().any(|a| a == "--mmproj") && !self.args.iter().any(|a| a == "--no-mmproj-offload")
    }
}

impl Fake {
    fn new(behaviour: &Value) -> Self {
        let _ = tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).with_test_writer().try_init();
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("model.json");
        std::fs::write(&model, behaviour.to_string()).expect("write the behaviour");
        let runtime_dir = dir.path().join("run");
        std::fs::create_dir(&runtime_dir).expect("runtime dir");
        let config = SupervisorConfig {
            llama_server: PathBuf::from(env!("CARGO_BIN_EXE_fake-llama-server")),
            runtime_dir,
            inherited_env: vec![("PATH".into(), std::env::var_os("PATH").expect("PATH"))],
            log_sink: LogSink::Tracing,
            cgroups: None,
            stop_grace: Duration::from_secs(10),
            worker_link_timeout: Duration::from_secs(3),
        };
        Self { dir, model, projector: None, config, reap: Vec::new() }
    }

    /// Gives the model a projector file (its contents do not matter to the fake).
    fn with_projector(mut self) -> Self {
        let projector = self.dir.path().join("mmproj.gguf");
        std::fs::write(&projector, b"").expect("write the projector");
        self.projector = Some(projector);
        self
    }

    fn spec(&self, load_timeout: Duration) -> RunnerSpec {
        RunnerSpec {
            id: 1,
            model: "fake:latest".into(),
            files: ModelFiles { model: self.model.clone(), projector: self.projector.clone(), adapters: Vec::new() },
            options: LoadOptions::default(),
            placement: Placement::default(),
            load_timeout,
            memory_max: None,
            planned: Vec::new(),
        }
    }

    fn socket(&self) -> PathBuf {
        self.config.runtime_dir.join("runner-1.sock")
    }

    async fn load(&self, load_timeout: Duration) -> Result<Runner, LoadError> {
        within("the load", runner::load(&self.config, &self.spec(load_timeout))).await
    }

    /// Every start so far; remembers grandchildren for the cleanup.
    fn starts(&mut self) -> Vec<Start> {
        let mut path = self.model.clone().into_os_string();
        path.push(".starts");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let starts: Vec<Start> = text
            .lines()
            .map(|line| {
                let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad start line {line:?}: {e}"));
                let pid = |v: &Value| v.as_i64().and_then(|p| i32::try_from(p).ok());
                let fake = pid(&v["pid"]).expect("pid");
                Start {
                    pid: fake,
                    grandchild: pid(&v["grandchild"]).map(|pid| Grandchild { pid, group: fake }),
                    bound: v["bound"] == true,
                    args: v["args"]
                        .as_array()
                        .expect("args")
                        .iter()
                        .map(|a| a.as_str().expect("arg").to_owned())
                        .collect(),
                }
            })
            .collect();
        for grandchild in starts.iter().filter_map(|s| s.grandchild) {
            if !self.reap.contains(&grandchild) {
                self.reap.push(grandchild);
            }
        }
        starts
    }

    /// The only start; fails if there were more (a retry that should not have happened).
    fn only_start(&mut self) -> Start {
        let starts = self.starts();
        assert_eq!(starts.len(), 1, "exactly one start: {starts:?}");
        starts[0].clone()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        // A failed test must not leave its `sleep 1000` behind.
        for &grandchild in &self.reap {
            if !gone(grandchild) {
                let _ = kill(Pid::from_raw(grandchild.pid), Signal::SIGKILL);
            }
        }
    }
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future).await.unwrap_or_else(|_| panic!("{what} took more than {DEADLINE:?}"))
}

/// Polls `condition` every 20 ms until it holds, at most [`DEADLINE`].
async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    within(what, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Whether a grandchild no longer runs: no such pid, a zombie, or the pid reused outside
/// its process group. The group, not the command's name, says it is ours: the shell that
/// becomes `sleep` is in the group from its fork, before and after its `exec`.
fn gone(grandchild: Grandchild) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", grandchild.pid)) else { return true };
    // `pid (comm) state ppid pgrp …`: the comm may hold spaces and parentheses, the
    // fields follow the last `)`.
    let Some((_, tail)) = stat.rsplit_once(')') else { return true };
    let mut fields = tail.split_whitespace();
    let state = fields.next();
    let group = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
    group != Some(grandchild.group) || matches!(state, Some("Z" | "X"))
}

/// The child is reaped: no `/proc` entry at all (a zombie would still have one).
fn reaped(pid: i32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

fn exited(error: LoadError) -> Exit {
    match error {
        LoadError::Exited(exit) => exit,
        other => panic!("expected the child to exit while loading, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_while_loading_is_stalled_after_the_timeout_and_leaves_nothing_behind() {
    let mut fake = Fake::new(&json!({ "hang": true, "grandchild": true }));
    let timeout = Duration::from_secs(2);
    let (config, spec) = (fake.config.clone(), fake.spec(timeout));
    let started = Instant::now();
    let load = tokio::spawn(async move { runner::load(&config, &spec).await });

    until("the fake's start", || !fake.starts().is_empty()).await;
    let start = fake.only_start();
    assert!(start.bound && fake.socket().exists(), "the fake bound its socket before loading: {start:?}");
    let grandchild = start.grandchild.expect("a grandchild");

    let error = within("the stall", load).await.expect("the load task").expect_err("a hang never loads");
    let elapsed = started.elapsed();
    assert!(matches!(error, LoadError::Stalled { after, last: None } if after == timeout), "{error:?}");
    assert!(elapsed >= timeout, "stalled after {elapsed:?}, before the {timeout:?} timeout");
    assert!(reaped(start.pid), "the child {} is reaped once the load failed", start.pid);
    assert!(!fake.socket().exists(), "the socket is removed");
    until("the grandchild's death", || gone(grandchild)).await;
    assert_eq!(fake.starts().len(), 1, "a stall is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_longer_than_the_timeout_succeeds_while_it_prints_progress() {
    let timeout = Duration::from_secs(1);
    let load_ms = 3000;

    // The control: the same load without progress lines is a stall.
    let mut silent = Fake::new(&json!({ "load_ms": load_ms }));
    let error = silent.load(timeout).await.expect_err("a silent load longer than the timeout");
    assert!(matches!(error, LoadError::Stalled { .. }), "{error:?}");
    assert!(reaped(silent.only_start().pid));

    let mut fake = Fake::new(&json!({ "load_ms": load_ms, "progress_every_ms": 100 }));
    let runner = fake.load(timeout).await.expect("progress keeps the load alive");
    assert!(runner.load_time() >= Duration::from_millis(load_ms), "loaded in {:?}", runner.load_time());
    assert!(runner.report().model_loaded());
    assert!(runner.report().ram_bytes() > 0, "the buffer lines were parsed: {:?}", runner.report());
    assert_eq!(runner.pid().as_raw(), fake.only_start().pid);
    assert_eq!(runner.socket(), fake.socket());
    assert!(!runner.projector_on_cpu());

    let health = tokio::task::spawn_blocking({
        let socket = fake.socket();
        move || http::unix(&socket, "GET", "/health", None)
    })
    .await
    .expect("health");
    assert_eq!((health.status, health.json()), (200, json!({ "status": "ok" })));

    // A plain stop: SIGTERM, and the fake exits 0 on SIGTERM only.
    let pid = runner.pid().as_raw();
    let exit = within("the stop", runner.stop()).await;
    assert!(exit.requested && exit.status.success() && exit.failure.is_none(), "{exit:?}");
    assert!(reaped(pid));
    assert!(!fake.socket().exists(), "the socket is removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_while_loading_is_reported_with_its_status_errors_and_class() {
    let bad_magic = "gguf_init_from_reader: invalid magic characters: '??H)', expected 'GGUF'";
    let bad_model = "llama_model_load: error loading model: llama_model_loader: failed to load model";
    let bind = "srv          init: couldn't bind HTTP server socket, hostname: /run/corral/x.sock, port: 8080";
    // (case, behaviour, failure, (exit code, signal)); the error lines are the behaviour's.
    let cases = [
        ("a corrupt model file", json!({ "errors": [bad_magic, bad_model] }), Failure::BadModelFile, (Some(1), None)),
        ("a bind failure", json!({ "errors": [bind] }), Failure::BindFailure, (Some(1), None)),
        ("an exit with no error line", json!({ "exit_code": 3 }), Failure::Crashed, (Some(3), None)),
        ("a SIGKILL (the OOM killer)", json!({ "exit_signal": 9 }), Failure::Killed, (None, Some(9))),
    ];
    for (name, mut behaviour, failure, status) in cases {
        let errors: Vec<String> = behaviour.get("errors").map_or_else(Vec::new, |e| {
            e.as_array().expect("errors").iter().map(|e| e.as_str().expect("error").to_owned()).collect()
        });
        behaviour["exit_after_ms"] = json!(200);
        behaviour["load_ms"] = json!(600_000);
        let mut fake = Fake::new(&behaviour);
        let started = Instant::now();
        let exit = exited(fake.load(NO_TIMEOUT).await.expect_err(name));
        assert!(started.elapsed() < NO_TIMEOUT, "{name}: the exit, not a stall, ended the load");
        assert_eq!(exit.failure, Some(failure), "{name}: {exit:?}");
        assert_eq!((exit.status.code(), exit.status.signal()), status, "{name}: {exit:?}");
        assert!(!exit.requested, "{name}: {exit:?}");
        assert_eq!(exit.last_errors, errors, "{name}");
        assert!(reaped(fake.only_start().pid), "{name}");
        assert!(!fake.socket().exists(), "{name}: the socket is removed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_memory_load_fails_as_such_and_is_not_retried_without_a_projector_on_the_gpu() {
    // No projector.
    let mut fake = Fake::new(&json!({ "oom": true }));
    let exit = exited(fake.load(NO_TIMEOUT).await.expect_err("out of memory"));
    assert_eq!(exit.failure, Some(Failure::OutOfMemory), "{exit:?}");
    assert_eq!(exit.status.code(), Some(1), "{exit:?}");
    assert!(!exit.requested);
    assert_eq!(exit.last_errors.first().map(String::as_str), Some(CONTEXT_OOM), "{exit:?}");
    assert!(exit.last_errors.iter().any(|e| e.contains("exiting due to model loading error")), "{exit:?}");
    let start = fake.only_start();
    assert!(reaped(start.pid));

    // A projector already on the CPU: nothing to retry with.
    let mut fake = Fake::new(&json!({ "oom": true })).with_projector();
    let mut spec = fake.spec(NO_TIMEOUT);
    spec.placement.projector_on_cpu = true;
    let error = within("the load", runner::load(&fake.config, &spec)).await.expect_err("out of memory");
    assert_eq!(error.failure(), Some(Failure::OutOfMemory), "{error:?}");
    let start = fake.only_start();
    assert!(start.args.iter().any(|a| a == "--no-mmproj-offload"), "{start:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_out_of_memory_is_retried_once_with_the_projector_on_the_cpu() {
    let mut fake = Fake::new(&json!({ "oom_on_projector_offload": true })).with_projector();
    let runner = fake.load(NO_TIMEOUT).await.expect("the retry with the projector on the CPU loads");
    assert!(runner.projector_on_cpu());
    let starts = fake.starts();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert!(starts[0].projector_offloaded(), "the first try offloads the projector: {starts:?}");
    assert!(!starts[1].projector_offloaded(), "the retry keeps it on the CPU: {starts:?}");
    assert!(starts[1].args.iter().any(|a| a == "--mmproj"), "the retry still loads the projector: {starts:?}");
    assert!(reaped(starts[0].pid), "the first child is reaped");
    assert_eq!(runner.pid().as_raw(), starts[1].pid);
    let exit = within("the stop", runner.stop()).await;
    assert!(exit.requested && exit.failure.is_none(), "{exit:?}");

    // Out of memory either way: one retry, then the retry's failure.
    let mut fake = Fake::new(&json!({ "oom": true })).with_projector();
    let exit = exited(fake.load(NO_TIMEOUT).await.expect_err("out of memory twice"));
    assert_eq!(exit.failure, Some(Failure::OutOfMemory), "{exit:?}");
    let starts = fake.starts();
    assert_eq!(starts.len(), 2, "exactly one retry: {starts:?}");
    assert!(starts[0].projector_offloaded() && !starts[1].projector_offloaded(), "{starts:?}");
    assert!(starts.iter().all(|s| reaped(s.pid)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_dies_after_it_is_ready_resolves_exited() {
    let cuda_oom = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: cudaMalloc failed: out of memory";
    let cases = [
        ("an out-of-memory exit", json!({ "exit_code": 1, "errors": [cuda_oom] }), Failure::OutOfMemory, Some(1), None),
        ("a SIGKILL", json!({ "exit_signal": 9 }), Failure::Killed, None, Some(9)),
    ];
    for (name, mut behaviour, failure, code, signal) in cases {
        behaviour["exit_after_healthy_ms"] = json!(300);
        let fake = Fake::new(&behaviour);
        let mut runner = fake.load(NO_TIMEOUT).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        let pid = runner.pid().as_raw();
        let exit = within("the exit", runner.exited()).await;
        assert!(!exit.requested, "{name}: {exit:?}");
        assert_eq!(exit.failure, Some(failure), "{name}: {exit:?}");
        assert_eq!((exit.status.code(), exit.status.signal()), (code, signal), "{name}: {exit:?}");
        if code.is_some() {
            assert_eq!(exit.last_errors, [cuda_oom], "{name}");
        }
        assert!(reaped(pid), "{name}");
        assert!(!fake.socket().exists(), "{name}: the socket is removed");
        // Stopping a runner that already ended reports how it ended.
        let again = within("the stop", runner.stop()).await;
        assert!(!again.requested && again.failure == Some(failure), "{name}: {again:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let mut fake = Fake::new(&json!({ "ignore_sigterm": true }));
    let grace = Duration::from_secs(1);
    fake.config.stop_grace = grace;
    let runner = fake.load(NO_TIMEOUT).await.expect("load");
    let pid = runner.pid().as_raw();
    let started = Instant::now();
    let exit = within("the stop", runner.stop()).await;
    let elapsed = started.elapsed();
    assert!(exit.requested && exit.failure.is_none(), "{exit:?}");
    assert_eq!(exit.status.signal(), Some(Signal::SIGKILL as i32), "{exit:?}");
    assert!(elapsed >= grace, "killed after {elapsed:?}, before the {grace:?} grace period");
    assert!(reaped(pid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grandchildren_die_when_the_runner_is_stopped() {
    let mut fake = Fake::new(&json!({ "grandchild": true }));
    let runner = fake.load(NO_TIMEOUT).await.expect("load");
    let grandchild = fake.only_start().grandchild.expect("a grandchild");
    assert!(!gone(grandchild), "the grandchild runs while the runner does");
    let exit = within("the stop", runner.stop()).await;
    assert!(exit.requested && exit.status.success(), "the fake itself exits on SIGTERM: {exit:?}");
    // The grandchild ignores SIGTERM: only the process group's SIGKILL ends it.
    until("the grandchild's death", || gone(grandchild)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grandchildren_die_when_the_runner_dies_on_its_own() {
    let mut fake = Fake::new(&json!({ "grandchild": true, "exit_after_healthy_ms": 300, "exit_code": 2 }));
    let mut runner = fake.load(NO_TIMEOUT).await.expect("load");
    let grandchild = fake.only_start().grandchild.expect("a grandchild");
    let exit = within("the exit", runner.exited()).await;
    assert_eq!(
        (exit.requested, exit.failure, exit.status.code()),
        (false, Some(Failure::Crashed), Some(2)),
        "{exit:?}"
    );
    until("the grandchild's death", || gone(grandchild)).await;
}
