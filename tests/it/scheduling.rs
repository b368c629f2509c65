//! The scheduler with real llama-server runners: a fixed memory inventory that holds one
//! of two tiny models forces an eviction; and corrald preloading a model from its
//! configuration, reporting it in STATUS=, and reaping it at stop.

use std::sync::Arc;
use std::time::Duration;

use corral::scheduler::actor::Scheduler;
use corral::scheduler::footprints::Footprints;
use corral::scheduler::request::{self, Defaults};
use corral::store::name::ModelName;
use nix::sys::signal::Signal;

use crate::support::api::{backend, demo_store, limits};
use crate::support::corrald::{Corrald, on_demo_store_with};
use crate::support::http;
use crate::support::notify::NotifyListener;

const WAIT: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

/// True while `pid` runs (exists and is not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_inventory_that_holds_one_model_evicts_the_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = demo_store(dir.path());
    let defaults = Defaults { num_ctx: 512, parallel: 1 };
    let build = |name: &str| {
        request::build(
            &store,
            &ModelName::parse(name).expect("name"),
            &request::LoadOverrides::default(),
            None,
            false,
            defaults,
        )
        .expect("request")
    };
    let (chat, embed) = (build("chat"), build("embed"));
    // Room for either model's estimate, not for both (even once the first one's real,
    // smaller footprint is learned).
    let host = chat.need.total().max(embed.need.total()) + MIB;
    let backend = backend(dir.path());
    let limits = limits();
    let footprints = dir.path().join("footprints.json");
    let (scheduler, handle) =
        Scheduler::new(Arc::new(backend), Vec::new(), host, limits, Footprints::load(footprints.clone()));
    tokio::spawn(scheduler.run());

    let lease = tokio::time::timeout(WAIT, handle.acquire(chat)).await.expect("in time").expect("chat loads");
    let socket = lease.socket().to_owned();
    let completion = tokio::task::spawn_blocking(move || {
        http::unix(&socket, "POST", "/completion", Some(r#"{"prompt":"hello","n_predict":8}"#))
    })
    .await
    .expect("join");
    assert_eq!(completion.status, 200);
    assert_eq!(completion.json()["tokens_predicted"], 8);
    drop(lease);
    let loaded = handle.loaded().await.expect("loaded");
    let chat_pid = loaded[0].pid.expect("pid");
    assert!(
        loaded[0].footprint.total() > 0 && loaded[0].footprint.total() < 64 * MIB,
        "the measured footprint: {loaded:?}"
    );

    let lease = tokio::time::timeout(WAIT, handle.acquire(embed)).await.expect("in time").expect("embed loads");
    assert!(!alive(chat_pid), "chat's llama-server was stopped and reaped to make room");
    let socket = lease.socket().to_owned();
    let embedding = tokio::task::spawn_blocking(move || {
        http::unix(&socket, "POST", "/v1/embeddings", Some(r#"{"input":"hello world"}"#))
    })
    .await
    .expect("join");
    assert_eq!(embedding.status, 200, "{}", embedding.body);
    assert_eq!(embedding.json()["data"][0]["embedding"].as_array().map(Vec::len), Some(64));
    let names: Vec<String> = handle.loaded().await.expect("loaded").into_iter().map(|m| m.name).collect();
    assert_eq!(names, ["embed:latest"]);
    // Both real footprints are learned and kept for the next start (written off the
    // scheduler's task, so the file may lag a moment).
    let (chat_key, embed_key) = (build("chat").key, build("embed").key);
    crate::support::container::poll_until(WAIT, "both footprints on disk", || {
        let learned = Footprints::load(footprints.clone());
        match (learned.get(&chat_key), learned.get(&embed_key)) {
            (Some(chat), Some(_)) if chat.total() < 64 * MIB => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    drop(lease);
    let embed_pid = handle.loaded().await.expect("loaded")[0].pid.expect("pid");
    tokio::time::timeout(WAIT, handle.shutdown()).await.expect("shutdown in time");
    assert!(!alive(embed_pid), "shutdown reaps every runner");
}

/// The runner pids of the `offload` events corrald logged.
fn runner_pids(corrald: &Corrald) -> Vec<u32> {
    corrald
        .stderr()
        .split("corral_runner_pid=")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().next().and_then(|p| p.parse().ok()))
        .collect()
}

#[test]
fn corrald_preloads_a_configured_model_reports_it_and_reaps_it_at_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let (mut corrald, port) =
        on_demo_store_with(dir.path(), "[models.\"chat\"]\npreload = true\npinned = true\n", &notify);
    notify.wait_for("READY", "1", WAIT);
    notify.wait_for("STATUS", &format!("serving on 127.0.0.1:{port}; 1 model loaded"), WAIT);
    corrald.wait_stderr("corral_event=\"offload\"", WAIT);
    corrald.wait_stderr("corral_runner_pid=", WAIT);
    let pids = runner_pids(&corrald);
    assert_eq!(pids.len(), 1, "{}", corrald.stderr());
    assert!(alive(pids[0]), "the runner runs");
    corrald.signal(Signal::SIGTERM);
    assert!(corrald.wait_exit(WAIT).success(), "{}", corrald.stderr());
    assert!(!alive(pids[0]), "corrald reaped its runner before exiting");
}

#[test]
fn no_runner_outlives_a_sigkilled_corrald() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notify = NotifyListener::start();
    let models = "[models.\"chat\"]\npreload = true\n[models.\"embed\"]\npreload = true\n";
    let (mut corrald, port) = on_demo_store_with(dir.path(), models, &notify);
    notify.wait_for("STATUS", &format!("serving on 127.0.0.1:{port}; 2 models loaded"), WAIT);
    // The offload lines may reach the pipe a moment after the status.
    let runners = crate::support::container::poll_until(WAIT, "two offload events", || {
        let pids = runner_pids(&corrald);
        if pids.len() == 2 { Ok(pids) } else { Err(corrald.stderr()) }
    });
    corrald.signal(Signal::SIGKILL);
    corrald.wait_exit(WAIT);
    crate::support::container::poll_until(WAIT, "both runners to die with corrald", || {
        let left: Vec<u32> = runners.iter().copied().filter(|pid| alive(*pid)).collect();
        if left.is_empty() { Ok(()) } else { Err(format!("still running: {left:?}")) }
    });
}
