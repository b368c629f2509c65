//! The supervisor against the real llama-server: readiness, parsed load reports (CPU and
//! a local rpc-server standing in for a GPU), classified failures, crashes, a clean stop,
//! and the child's environment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use corral::supervisor::child_log::LogSink;
use corral::supervisor::command::{LoadOptions, ModelFiles, Placement};
use corral::supervisor::logparse::BufferKind;
use corral::supervisor::runner::{self, Failure, LoadError, RunnerSpec, SupervisorConfig};
use nix::sys::signal::{Signal, kill};

use crate::support::corrald::free_port;
use crate::support::{http, llama};

const LOAD_TIMEOUT: Duration = Duration::from_secs(60);

fn config(runtime_dir: &Path) -> SupervisorConfig {
    SupervisorConfig {
        llama_server: llama::bin_dir().join("llama-server"),
        runtime_dir: runtime_dir.to_owned(),
        inherited_env: vec![
            ("PATH".into(), std::env::var_os("PATH").unwrap_or_default()),
            ("NOTIFY_SOCKET".into(), "/run/systemd/notify".into()),
            ("LISTEN_FDS".into(), "1".into()),
        ],
        log_sink: LogSink::Tracing,
        cgroups: None,
        stop_grace: Duration::from_secs(10),
        worker_link_timeout: Duration::from_secs(3),
    }
}

fn spec(id: u64, model: PathBuf, options: LoadOptions, placement: Placement) -> RunnerSpec {
    RunnerSpec {
        id,
        model: "tiny:latest".into(),
        files: ModelFiles { model, projector: None, adapters: Vec::new() },
        options: LoadOptions { num_ctx: 512, ..options },
        placement,
        load_timeout: LOAD_TIMEOUT,
        memory_max: None,
        planned: Vec::new(),
    }
}

fn tiny_llama(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-llama.gguf");
    corral::demo_model::write_tiny_llama(&path).expect("write model");
    path
}

fn environ(pid: nix::unistd::Pid) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("read environ");
    raw.split(|b| *b == 0).filter(|v| !v.is_empty()).map(|v| String::from_utf8_lossy(v).into_owned()).collect()
}

#[tokio::test]
async fn a_real_load_is_ready_reports_its_buffers_and_stops_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    let spec = spec(
        1,
        tiny_llama(dir.path()),
        LoadOptions { num_gpu: Some(0), ..LoadOptions::default() },
        Placement::default(),
    );
    let runner = runner::load(&config, &spec).await.expect("tiny model loads");

    assert_eq!(runner.socket(), dir.path().join("runner-1.sock"));
    let report = runner.report();
    assert!(report.model_loaded());
    let offload = report.offload().expect("the RPC-enabled build prints the offload line");
    assert_eq!((offload.gpu_layers, offload.total_layers), (0, 5));
    assert!(report.buffer_bytes("CPU_Mapped", BufferKind::Model) > 400_000, "{report:?}");
    assert!(report.buffer_bytes("CPU", BufferKind::Kv) > 0, "{report:?}");
    assert_eq!(report.vram_bytes(), 0);
    assert!(report.ram_bytes() >= report.buffer_bytes("CPU_Mapped", BufferKind::Model));
    assert!(runner.load_time() < LOAD_TIMEOUT);

    // The child: its own process group, a clean environment, serving on the socket.
    let pid = runner.pid();
    assert_eq!(nix::unistd::getpgid(Some(pid)).expect("pgid"), pid);
    let env = environ(pid);
    assert!(env.iter().any(|v| v.starts_with("PATH=")), "{env:?}");
    assert!(!env.iter().any(|v| v.starts_with("NOTIFY_SOCKET=") || v.starts_with("LISTEN_")), "{env:?}");
    let socket = runner.socket().to_owned();
    let health = tokio::task::spawn_blocking(move || http::unix(&socket, "GET", "/health", None)).await.expect("join");
    assert_eq!(health.status, 200);

    let exit = runner.stop().await;
    assert!(exit.requested && exit.status.success() && exit.failure.is_none(), "{exit:?}");
    assert!(!dir.path().join("runner-1.sock").exists(), "the socket file is removed");
    assert!(kill(pid, None).is_err(), "the child is gone");
}

#[tokio::test]
async fn offload_to_an_rpc_device_is_parsed_from_real_output() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let _rpc = llama::RpcServer::start(port);
    let config = config(dir.path());
    let placement = Placement { rpc_servers: vec![format!("127.0.0.1:{port}")], ..Placement::default() };
    for (layers, expected_gpu) in [(99, 5), (2, 2)] {
        let spec = spec(
            layers,
            tiny_llama(dir.path()),
            LoadOptions { num_gpu: Some(layers.try_into().expect("u32")), ..LoadOptions::default() },
            placement.clone(),
        );
        let runner = runner::load(&config, &spec).await.expect("loads with the rpc device");
        let report = runner.report().clone();
        let offload = report.offload().expect("offload line");
        assert_eq!((offload.gpu_layers, offload.total_layers), (expected_gpu, 5), "-ngl {layers}");
        let rpc_model = report
            .buffers()
            .filter(|(key, _)| key.buffer.starts_with("RPC") && key.kind == BufferKind::Model)
            .map(|(_, bytes)| bytes)
            .sum::<u64>();
        assert!(rpc_model > 0, "model weights on the rpc device: {report:?}");
        assert!(report.vram_bytes() >= rpc_model, "{report:?}");
        assert!(runner.stop().await.status.success());
    }
}

#[tokio::test]
async fn a_corrupt_model_fails_the_load_with_a_classified_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("garbage.gguf");
    std::fs::write(&model, b"\x01\x02\x03\x04 not a gguf file at all, just bytes").expect("write");
    let err = runner::load(&config(dir.path()), &spec(2, model, LoadOptions::default(), Placement::default()))
        .await
        .expect_err("garbage does not load");
    let LoadError::Exited(exit) = &err else { panic!("expected an exit, got {err:?}") };
    assert_eq!(exit.failure, Some(Failure::BadModelFile), "{exit:?}");
    assert_eq!(exit.status.code(), Some(1));
    assert!(exit.last_errors.iter().any(|l| l.contains("invalid magic")), "{exit:?}");
    assert!(err.to_string().contains("bad model file"), "{err}");
    assert!(!dir.path().join("runner-2.sock").exists());
}

#[tokio::test]
async fn a_runner_killed_from_outside_is_reported_as_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path());
    let mut runner =
        runner::load(&config, &spec(3, tiny_llama(dir.path()), LoadOptions::default(), Placement::default()))
            .await
            .expect("loads");
    kill(runner.pid(), Signal::SIGKILL).expect("kill");
    let exit = tokio::time::timeout(LOAD_TIMEOUT, runner.exited()).await.expect("the exit is noticed");
    assert!(!exit.requested);
    assert_eq!(exit.failure, Some(Failure::Killed), "{exit:?}");
    assert!(!dir.path().join("runner-3.sock").exists(), "the socket file is removed");
    let after_stop = runner.stop().await;
    assert_eq!(after_stop.failure, Some(Failure::Killed), "stop after a crash reports the crash");
}

#[tokio::test]
async fn a_missing_llama_server_is_a_spawn_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = SupervisorConfig { llama_server: "/nonexistent/llama-server".into(), ..config(dir.path()) };
    let err = runner::load(&config, &spec(4, tiny_llama(dir.path()), LoadOptions::default(), Placement::default()))
        .await
        .expect_err("no binary");
    assert!(matches!(err, LoadError::Spawn { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cannot start llama-server ([runner] llama_server = /nonexistent/llama-server)"),
        "{err}"
    );
}

#[tokio::test]
async fn llama_server_rejecting_an_option_is_an_invalid_argument() {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = LoadOptions { kv_cache_type: Some("not-a-type".into()), ..LoadOptions::default() };
    let err = runner::load(&config(dir.path()), &spec(5, tiny_llama(dir.path()), options, Placement::default()))
        .await
        .expect_err("bad cache type");
    let LoadError::Exited(exit) = &err else { panic!("expected an exit, got {err:?}") };
    assert_eq!(exit.failure, Some(Failure::InvalidArgument), "{exit:?}");
}
