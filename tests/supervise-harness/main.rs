//! A small driver of corral's supervisor for tests that need whole processes: it loads
//! each model given on the command line as a real llama-server runner, prints
//! `ready <id> <pid>` for each on stdout, and stops them all on SIGTERM or SIGINT.
//!
//! It stands where the daemon's scheduler will: the containment test SIGKILLs it with
//! runners loaded (no llama-server may survive), and the journald test runs it under a
//! real journald. Not packaged.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use corral::cli::LogTarget;
use corral::supervisor::cgroup::{CgroupTree, cgroup2_mount};
use corral::supervisor::command::{LoadOptions, ModelFiles, Placement};
use corral::supervisor::runner::{self, LogSink, RunnerSpec, SupervisorConfig};
use corral::systemd::{JOURNAL_SOCKET, JournalWriter};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
struct Args {
    /// The llama-server executable.
    #[arg(long)]
    llama_server: PathBuf,
    /// Where runner sockets go.
    #[arg(long)]
    runtime_dir: PathBuf,
    /// Where logs (the harness's and llama-server's) go.
    #[arg(long, value_enum, default_value_t = LogTarget::Stderr)]
    log_target: LogTarget,
    /// Put each runner in its own cgroup; fails when there is no delegated cgroup tree.
    #[arg(long)]
    cgroups: bool,
    /// llama.cpp RPC workers to offload to.
    #[arg(long)]
    rpc: Vec<String>,
    /// Layers on the GPU (`-ngl`).
    #[arg(long)]
    ngl: Option<u32>,
    /// Model files to load, in order.
    models: Vec<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let target = corral::logging::init(args.log_target, false);
    let cgroups = if args.cgroups {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let Some(cgroup_fs) = cgroup2_mount(&mountinfo) else { return fail("cgroup2 is not mounted") };
        match CgroupTree::adopt(&cgroup_fs, &own) {
            Ok(Some(tree)) => {
                let stale = tree.kill_stale().unwrap_or_default();
                tracing::info!(root = %tree.root().display(), ?stale, "runners get their own cgroups");
                Some(tree)
            }
            Ok(None) => return fail("no delegated cgroup tree"),
            Err(e) => return fail(&format!("cannot set up cgroups: {e}")),
        }
    } else {
        None
    };
    let log_sink = match target {
        LogTarget::Journal => match JournalWriter::new(std::path::Path::new(JOURNAL_SOCKET)) {
            Ok(writer) => LogSink::Journal(Arc::new(writer)),
            Err(e) => return fail(&format!("cannot reach the journal: {e}")),
        },
        _ => LogSink::Tracing,
    };
    let config = SupervisorConfig {
        llama_server: args.llama_server,
        runtime_dir: args.runtime_dir,
        inherited_env: vec![("PATH".into(), std::env::var_os("PATH").unwrap_or_default())],
        log_sink,
        cgroups,
        stop_grace: Duration::from_secs(5),
    };
    let mut sigterm = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut sigint = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut runners = Vec::new();
    for (id, model) in (1..).zip(&args.models) {
        let name = model.file_stem().map_or_else(|| format!("model-{id}"), |s| s.to_string_lossy().into_owned());
        let spec = RunnerSpec {
            id,
            model: name,
            files: ModelFiles { model: model.clone(), projector: None, adapters: Vec::new() },
            options: LoadOptions { num_ctx: 512, num_gpu: args.ngl, ..LoadOptions::default() },
            placement: Placement { rpc_servers: args.rpc.clone(), ..Placement::default() },
            load_timeout: Duration::from_secs(60),
            memory_max: None,
            planned: Vec::new(),
        };
        match runner::load(&config, &spec).await {
            Ok(runner) => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "ready {id} {}", runner.pid());
                let _ = out.flush();
                runners.push(runner);
            }
            Err(e) => return fail(&format!("load of {} failed: {e}", model.display())),
        }
    }
    tokio::select! {
        _ = sigterm.recv() => {}
        _ = sigint.recv() => {}
    }
    for runner in runners {
        runner.stop().await;
    }
    ExitCode::SUCCESS
}

fn fail(message: &str) -> ExitCode {
    tracing::error!("{message}");
    let _ = writeln!(std::io::stderr(), "supervise-harness: {message}");
    ExitCode::FAILURE
}
