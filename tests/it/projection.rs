//! llama.cpp's memory projection: the real `llama-fit-params` on the tiny model, on the CPU
//! and with two local `rpc-server`s as devices; its failures as typed errors; the cache
//! across a restart.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use corral::config::RunnerConfig;
use corral::projection::{DryRun, ParseError, Projection, ProjectionCache, ProjectionError, ProjectionKey, Projector};
use corral::store::digest::Digest;
use corral::supervisor::logparse::ErrorClass;

use crate::support::corrald::{CORRALD, free_port, write_config};
use crate::support::llama::{RpcServer, bin_dir};

const MIB: u64 = 1 << 20;

/// Generous: a projection takes well under a second, but the machine is shared.
const TIMEOUT: Duration = Duration::from_secs(60);

/// The real `llama-fit-params`: beside llama-server, where the setup script installs it
/// (else in the build directory next to that, `../build-<key>/bin`).  Panics when neither
/// has it: these tests never skip.
fn llama_fit_params() -> PathBuf {
    let beside = bin_dir().join("llama-fit-params");
    if beside.is_file() {
        return beside;
    }
    let dir = bin_dir();
    let key = dir.parent().and_then(Path::file_name).expect("the cache's key directory").to_string_lossy();
    let built =
        dir.parent().and_then(Path::parent).expect("the cache").join(format!("build-{key}/bin/llama-fit-params"));
    assert!(built.is_file(), "no llama-fit-params beside {} nor at {}", beside.display(), built.display());
    built
}

fn projector() -> Projector {
    Projector { program: llama_fit_params(), timeout: TIMEOUT }
}

fn tiny_llama() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny-llama.gguf");
    corral::demo_model::write_tiny_llama(&path).expect("write the model");
    (dir, path)
}

fn args(model: &Path, rest: &[&str]) -> Vec<OsString> {
    let mut args = vec![OsString::from("-m"), model.as_os_str().to_owned()];
    args.extend(rest.iter().map(OsString::from));
    args
}

fn names(projection: &Projection) -> Vec<&str> {
    projection.devices().iter().map(|d| d.name.as_str()).collect()
}

fn block_on<T>(future: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(future)
}

#[test]
fn the_cpu_projection_is_the_host_row_alone() {
    let (_dir, model) = tiny_llama();
    let p = block_on(projector().project(&args(&model, &["-ngl", "0", "-c", "2048"]), &[])).expect("a projection");
    assert!(p.devices().is_empty(), "{p:?}");
    // The KV cache of 2048 tokens (4 layers, 32 K and V values each, f16) is 1 MiB.
    assert_eq!(p.host().context, MIB, "{p:?}");
    assert!(p.host().compute > 0, "{p:?}");
    assert_eq!(p.host_total(), p.host().model + p.host().context + p.host().compute);
}

#[test]
fn two_rpc_servers_are_two_devices_and_the_layers_decide_where_the_context_goes() {
    let (_dir, model) = tiny_llama();
    let (a, b) = (free_port(), free_port());
    let _servers = (RpcServer::start(a), RpcServer::start(b));
    let rpc = format!("127.0.0.1:{a},127.0.0.1:{b}");
    let projector = projector();

    let split = ["--rpc", &rpc, "--device", "RPC0,RPC1", "-ngl", "99", "-ts", "1,1", "--fit", "off"];
    let p = block_on(projector.project(&args(&model, &split), &[])).expect("a projection");
    assert_eq!(names(&p), ["RPC0", "RPC1"], "{p:?}");
    for name in ["RPC0", "RPC1"] {
        let usage = p.device(name).expect("a row");
        assert!(usage.compute > 0, "{name}: {p:?}");
        assert_eq!(p.device_total(name), Some(usage.total()));
    }
    assert!(p.host().compute > 0, "{p:?}");

    // One device: with every layer on it, the 1 MiB of KV cache is there; with none, on the host.
    let on = |ngl: &str| {
        let one = ["--rpc", &rpc, "--device", "RPC0", "-ngl", ngl, "--fit", "off", "-c", "2048"];
        block_on(projector.project(&args(&model, &one), &[])).expect("a projection")
    };
    let all = on("99");
    assert_eq!(names(&all), ["RPC0"], "{all:?}");
    assert_eq!((all.device("RPC0").expect("row").context, all.host().context), (MIB, 0), "{all:?}");
    let none = on("0");
    assert_eq!((none.device("RPC0").expect("row").context, none.host().context), (0, MIB), "{none:?}");
}

#[test]
fn the_projector_is_found_beside_llama_server() {
    let server = bin_dir().join("llama-server");
    let runner = RunnerConfig { llama_server: server, ..RunnerConfig::default() };
    let projector = Projector::from_config(&runner, None).expect("llama-fit-params beside llama-server");
    assert_eq!(projector.program, bin_dir().join("llama-fit-params"));
    assert_eq!(projector.timeout, Duration::from_secs(30));
}

/// An executable shell script `name` in `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}")).expect("write the script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// Waits until `pid` is gone or a zombie (killed, awaiting its reaper), at most 10 s.
fn wait_dead(pid: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(stat) if stat.rsplit(") ").next().is_some_and(|rest| rest.starts_with('Z')) => return true,
            Ok(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    false
}

#[test]
fn a_slow_projection_is_killed_at_the_timeout_with_its_process_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pids = dir.path().join("pids");
    // The program and a child of its own (as a crashing llama.cpp starts a debugger).
    let body = format!("sleep 600 &\necho $$ $! > {}\nwait\n", pids.display());
    let program = script(dir.path(), "slow", &body);
    let projector = Projector { program: program.clone(), timeout: Duration::from_millis(300) };
    let started = Instant::now();
    let err = block_on(projector.project(&[], &[])).expect_err("too slow");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
    assert!(
        matches!(&err, ProjectionError::TimedOut { program: p, after } if *p == program && *after == Duration::from_millis(300))
    );
    let text = err.to_string();
    assert!(text.contains("did not finish within 300 ms") && text.contains("[runner] projection_timeout"), "{text}");
    let pids = std::fs::read_to_string(&pids).expect("the script wrote its pids");
    for pid in pids.split_whitespace() {
        assert!(wait_dead(pid), "process {pid} outlived the timeout");
    }
}

#[test]
fn a_failing_projection_says_how_it_ended_and_its_error_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let program = script(
        dir.path(),
        "failing",
        "echo '0.00.001.000 I llama_model_loader: loaded meta data' >&2\n\
         echo '0.00.002.000 E llama_model_load: error loading model: tensor data is not within the file bounds' >&2\n\
         echo 'Host 0 0 1'\nexit 1\n",
    );
    let err = block_on(Projector { program, timeout: TIMEOUT }.project(&[], &[])).expect_err("failed");
    let ProjectionError::Failed { status, class, message, .. } = &err else { panic!("{err:?}") };
    assert_eq!(status.code(), Some(1));
    assert_eq!(*class, Some(ErrorClass::BadModelFile));
    assert_eq!(
        message.as_deref(),
        Some("llama_model_load: error loading model: tensor data is not within the file bounds")
    );
    let text = err.to_string();
    assert!(text.contains("failed (exit status: 1): llama_model_load: error loading"), "{text}");

    // The real one on a file that is not there: it aborts on an uncaught exception.  Its own
    // `E` lines are written by its log thread and may be lost in the abort: the message is
    // either `gguf_init_from_file: failed to open GGUF file …` or `what():  failed to load model`.
    let (_model_dir, model) = tiny_llama();
    let missing = model.with_file_name("missing.gguf");
    let err = block_on(projector().project(&args(&missing, &["-ngl", "0"]), &[])).expect_err("no model");
    let ProjectionError::Failed { status, message, .. } = &err else { panic!("{err:?}") };
    assert!(!status.success() && status.code().is_none(), "killed by SIGABRT: {err}");
    assert!(message.as_deref().is_some_and(|m| m.contains("failed to")), "{err}");
    // And on a server-only flag.
    let err = block_on(projector().project(&args(&model, &["--host", "x"]), &[])).expect_err("a server flag");
    assert!(matches!(&err, ProjectionError::Failed { class: Some(ErrorClass::InvalidArgument), .. }), "{err}");
}

#[test]
fn a_missing_program_or_unreadable_output_is_a_typed_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("llama-fit-params");
    let err = block_on(Projector { program: missing.clone(), timeout: TIMEOUT }.project(&[], &[])).expect_err("none");
    assert!(matches!(&err, ProjectionError::NotFound { program } if *program == missing), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&missing.display().to_string()) && text.contains("[runner] llama_fit_params"), "{text}");

    let garbage = script(dir.path(), "garbage", "echo '-c 4096 -ngl 99'\n");
    let err = block_on(Projector { program: garbage, timeout: TIMEOUT }.project(&[], &[])).expect_err("garbage");
    assert!(
        matches!(&err, ProjectionError::Unreadable { source: ParseError::BadNumber { line: 1, .. }, .. }),
        "{err:?}"
    );
    // A flood: read up to the cap, the rest drained, and refused.
    let flood = script(dir.path(), "flood", "yes 'RPC0 0 0 1' | head -c 1000000\necho 'Host 0 0 1'\n");
    let err = block_on(Projector { program: flood, timeout: TIMEOUT }.project(&[], &[])).expect_err("too much");
    assert!(matches!(&err, ProjectionError::Unreadable { source: ParseError::TooLong, .. }), "{err:?}");
}

#[test]
fn the_program_gets_exactly_the_arguments_and_environment_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let seen = dir.path().join("seen");
    let body = format!(
        "for a in \"$@\"; do echo \"arg:$a\"; done > {seen}\n/usr/bin/env >> {seen}\necho \"RPC0 1 2 3 \"\n\
         echo \"Host 0 0 $COMPUTE \"\n",
        seen = seen.display()
    );
    let program = script(dir.path(), "echoing", &body);
    let env = [(OsString::from("COMPUTE"), OsString::from("7"))];
    let p =
        block_on(Projector { program, timeout: TIMEOUT }.project(&[OsString::from("-m"), OsString::from("a b")], &env))
            .expect("a projection");
    assert_eq!(p.device("RPC0").map(|u| (u.model, u.context, u.compute)), Some((MIB, 2 * MIB, 3 * MIB)));
    assert_eq!(p.host().compute, 7 * MIB);
    let seen = std::fs::read_to_string(&seen).expect("seen");
    let args: Vec<&str> = seen.lines().filter_map(|l| l.strip_prefix("arg:")).collect();
    assert_eq!(args, ["-m", "a b", "--fit-print", "on"]);
    let vars: Vec<&str> = seen.lines().filter(|l| !l.starts_with("arg:")).filter_map(|l| l.split('=').next()).collect();
    // The shell adds its own PWD; nothing of the test's environment (PATH, HOME) comes along.
    assert!(vars.contains(&"COMPUTE"), "{seen}");
    assert!(vars.iter().all(|v| ["COMPUTE", "PWD", "SHLVL", "_", "OLDPWD"].contains(v)), "{seen}");
}

#[test]
fn a_cached_projection_survives_a_reload_from_disk() {
    let (_dir, model) = tiny_llama();
    let projection =
        block_on(projector().project(&args(&model, &["-ngl", "0", "-c", "2048"]), &[])).expect("projection");
    let key = ProjectionKey {
        model: Digest::of(&std::fs::read(&model).expect("read the model")),
        projector: None,
        adapters: Vec::new(),
        context: 2048,
        parallel: 1,
        batch: None,
        flash_attention: None,
        kv_cache_type: None,
        embedding: false,
        devices: Vec::new(),
        gpu_layers: Some(0),
        tensor_split: Vec::new(),
        dry_run: false,
    };
    let state = tempfile::tempdir().expect("state directory");
    let path = state.path().join("projections.json");
    let mut cache = ProjectionCache::load(path.clone());
    assert!(cache.get(&key).is_none());
    cache.record(key.clone(), projection.clone()).expect("a write").write();
    let reloaded = ProjectionCache::load(path);
    assert_eq!(reloaded.get(&key), Some(&projection));
    assert_eq!(reloaded.get(&ProjectionKey { gpu_layers: Some(99), ..key }), None);
}

#[test]
fn check_config_warns_when_the_projector_is_missing_and_passes_anyway() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = bin_dir().join("llama-server");
    let check = |runner: &str| {
        let config = write_config(dir.path(), "corral.toml", &format!("[runner]\n{runner}"));
        let out = std::process::Command::new(CORRALD)
            .args(["--check-config", "--config"])
            .arg(&config)
            .output()
            .expect("run corrald");
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Beside llama-server: nothing to say.
    let stderr = check(&format!("llama_server = \"{}\"\n", server.display()));
    assert!(stderr.is_empty(), "{stderr}");
    let missing = dir.path().join("no-llama-fit-params");
    let stderr = check(&format!(
        "llama_server = \"{}\"\nllama_fit_params = \"{}\"\nprojection_timeout = \"10s\"\n",
        server.display(),
        missing.display()
    ));
    assert!(stderr.starts_with("corrald: warning: [runner] llama_fit_params: "), "{stderr}");
    assert!(stderr.contains(&format!("{} does not exist", missing.display())), "{stderr}");
    assert!(stderr.contains("planned with corral's estimate"), "{stderr}");
}

/// llama-server's dry run (an exact plan's projection) through `program`, its socket in `dir`.
fn dry_run(program: PathBuf, dir: &Path, timeout: Duration) -> DryRun {
    DryRun { llama_server: program, socket_dir: dir.to_owned(), timeout }
}

/// The memory table a dry run prints, at `-lv 5`, for one device and the host.
const TABLE: &str = "\
echo '0.00.037.479 I sched_reserve: RPC0[127.0.0.1:1] compute buffer size =    16.01 MiB' >&2
echo '0.00.038.276 I common_memory_breakdown_print: | memory breakdown [MiB] | total free self model context compute unaccounted |' >&2
echo '0.00.038.298 I common_memory_breakdown_print: |   - RPC0 (127.0.0.1:1) | 24105 = 24105 + (  35 =    15 +       4 +      16) +         -35 |' >&2
echo '0.00.038.298 I common_memory_breakdown_print: |   - Host               |                   143 =    98 +      26 +      19                |' >&2
";

#[test]
fn a_dry_run_is_stopped_once_its_table_is_read_before_it_loads_the_weights() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pids = dir.path().join("pids");
    // After its table llama-server would read the weights: here it hangs, with a child.
    // The pids are written before the table: the projection may stop the script as soon
    // as the table is read.
    let body = format!("sleep 600 &\necho $$ $! > {}\n{TABLE}wait\n", pids.display());
    let program = script(dir.path(), "llama-server", &body);
    let started = Instant::now();
    let buffers = [("RPC0".to_owned(), "RPC0[127.0.0.1:1]".to_owned())];
    let p = block_on(dry_run(program, dir.path(), TIMEOUT).project(&[], &[], 7, &buffers)).expect("a projection");
    assert!(started.elapsed() < Duration::from_secs(20), "stopped at the table, not at the timeout");
    assert_eq!(names(&p), ["RPC0"]);
    let rpc0 = p.device("RPC0").expect("a row");
    assert_eq!((rpc0.model, rpc0.context, rpc0.compute), (15 * MIB, 4 * MIB, 16 * MIB + 10_486));
    assert_eq!(p.host().model, 98 * MIB);
    let pids = std::fs::read_to_string(&pids).expect("the script wrote its pids");
    for pid in pids.split_whitespace() {
        assert!(wait_dead(pid), "process {pid} outlived its projection");
    }
}

#[test]
fn a_dry_run_gets_the_child_s_arguments_with_its_own_and_a_socket_it_does_not_keep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let seen = dir.path().join("seen");
    let body = format!("for a in \"$@\"; do echo \"arg:$a\"; done > {}\n{TABLE}", seen.display());
    let program = script(dir.path(), "llama-server", &body);
    let sockets = dir.path().join("run");
    std::fs::create_dir(&sockets).expect("mkdir");
    // A socket left by an earlier dry run of the same runner is removed first.
    std::fs::write(sockets.join("projection-7.sock"), "").expect("a stale socket");
    let args = [OsString::from("-m"), OsString::from("a b.gguf"), OsString::from("--fit"), OsString::from("off")];
    block_on(dry_run(program, &sockets, TIMEOUT).project(&args, &[], 7, &[])).expect("a projection");
    let seen = std::fs::read_to_string(&seen).expect("the script ran");
    let socket = sockets.join("projection-7.sock");
    let expected = format!(
        "arg:-m\narg:a b.gguf\narg:--fit\narg:off\narg:--fit\narg:on\narg:-lv\narg:5\narg:--offline\narg:--no-webui\narg:--host\narg:{}\n",
        socket.display()
    );
    assert_eq!(seen, expected);
    assert!(!socket.exists(), "the dry run's socket is gone");
}

#[test]
fn a_dry_run_that_fails_times_out_or_prints_no_table_is_a_typed_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let failing = script(
        dir.path(),
        "failing",
        "echo '0.00.002.000 E llama_model_load: error loading model: tensor data is not within the file bounds' >&2\nexit 1\n",
    );
    let err = block_on(dry_run(failing, dir.path(), TIMEOUT).project(&[], &[], 1, &[])).expect_err("failed");
    let ProjectionError::Failed { class, message, .. } = &err else { panic!("{err:?}") };
    assert_eq!(*class, Some(ErrorClass::BadModelFile));
    assert!(message.as_deref().is_some_and(|m| m.contains("not within the file bounds")), "{err}");

    let silent = script(dir.path(), "silent", "echo '0.00.001.000 I main: nothing to see' >&2\n");
    let err = block_on(dry_run(silent, dir.path(), TIMEOUT).project(&[], &[], 1, &[])).expect_err("no table");
    assert!(matches!(&err, ProjectionError::Unreadable { source: ParseError::NoHost, .. }), "{err:?}");

    let bad = script(
        dir.path(),
        "bad",
        "echo 'I common_memory_breakdown_print: |   - RPC0 (a) | 1 = 1 + ( 1 = 1 + x + 0 ) + 0 |' >&2\nsleep 600\n",
    );
    let started = Instant::now();
    let err = block_on(dry_run(bad, dir.path(), TIMEOUT).project(&[], &[], 1, &[])).expect_err("a bad row");
    assert!(started.elapsed() < Duration::from_secs(20), "a bad row ends the run at once");
    assert!(matches!(&err, ProjectionError::Unreadable { source: ParseError::BadNumber { .. }, .. }), "{err:?}");

    let slow = script(dir.path(), "slow", "sleep 600\n");
    let err = block_on(dry_run(slow.clone(), dir.path(), Duration::from_millis(300)).project(&[], &[], 1, &[]))
        .expect_err("too slow");
    assert!(matches!(&err, ProjectionError::TimedOut { program, .. } if *program == slow), "{err:?}");

    let missing = dir.path().join("missing");
    let err = block_on(dry_run(missing.clone(), dir.path(), TIMEOUT).project(&[], &[], 1, &[])).expect_err("none");
    assert!(matches!(&err, ProjectionError::NotFound { program } if *program == missing), "{err:?}");
}
