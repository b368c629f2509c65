//! `corrald`: takes what systemd passed, loads the configuration, and runs the daemon.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use corral::cli::Cli;
use corral::config::ConfigSource;
use corral::daemon::{self, Daemon};
use corral::paths::Paths;
use corral::{logging, systemd};

/// sysexits.h: a configuration error.
const EX_CONFIG: u8 = 78;
/// sysexits.h: an operating-system error (no usable environment to start in).
const EX_OSERR: u8 = 71;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(path) = &cli.write_demo_model {
        return match corral::demo_model::write_tiny_llama(path) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "corrald: cannot write {}: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    // First, while the process has one thread: take the sockets and variables systemd passed
    // and remove them from the environment, so that no child inherits them.
    let handoff = match systemd::Handoff::take() {
        Ok(handoff) => handoff,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "corrald: cannot take the systemd environment: {e}");
            return ExitCode::from(EX_OSERR);
        }
    };
    let paths = Paths::from_process_env();
    let source = cli.config_source(&paths);
    let base = cli.config_base();
    if cli.check_config {
        return check_config(&source, base);
    }

    let log_target = logging::init(cli.log_target, handoff.stderr_is_journal);
    let runtime =
        match tokio::runtime::Builder::new_multi_thread().worker_threads(worker_threads()).enable_all().build() {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the async runtime");
                return ExitCode::from(EX_OSERR);
            }
        };
    let loaded = match source.load_over(base.clone()) {
        Ok(loaded) => loaded,
        Err(e) => {
            // The reason is in the message itself: `journalctl -u corrald` and `systemctl
            // status` show messages, not fields.
            tracing::error!(
                corral_event = "config",
                error = %e,
                "invalid configuration, not starting: {e} (check with `corrald --check-config`)"
            );
            handoff.notifier.status(&format!("invalid configuration: {e}"));
            // The connections that started this instance are answered (where to look), so
            // that they do not start it again and again until corrald.socket gives up.
            runtime.block_on(daemon::refuse(handoff.sockets));
            return ExitCode::from(EX_CONFIG);
        }
    };
    let notifier = handoff.notifier.clone();
    let daemon = Daemon {
        source,
        base,
        loaded,
        paths,
        sockets: handoff.sockets,
        notifier: handoff.notifier,
        watchdog: handoff.watchdog,
        log_target,
    };
    match runtime.block_on(daemon::run(daemon)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let why = describe(&e);
            tracing::error!(corral_event = "stop", error = why, "corrald failed: {why}");
            notifier.status(&format!("failed: {why}"));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes, each once: the core's errors often name their cause in their
/// own message too (`cannot listen on ADDR: Address already in use`), and `{:#}` would
/// then repeat it.
fn describe(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let cause = cause.to_string();
        if text.ends_with(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// Tokio's workers: one per CPU (Tokio's default), at most [`MAX_WORKERS`]. corrald moves
/// bytes between sockets while llama-server computes: a few workers keep up with hundreds
/// of streams (`benches/many_clients.rs`), and each idle worker costs memory (its stack and
/// malloc arena) on a machine with many CPUs.
fn worker_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(MAX_WORKERS)
}

/// The most async worker threads corrald starts.
const MAX_WORKERS: usize = 4;

fn check_config(source: &ConfigSource, base: toml::Table) -> ExitCode {
    match source.load_over(base) {
        Ok(loaded) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "configuration is valid");
            if loaded.files.is_empty() {
                let _ = writeln!(out, "no file found at {}; using the built-in defaults", source.file.display());
            }
            for file in &loaded.files {
                let _ = writeln!(out, "read {}", file.display());
            }
            // Not an error: models cannot load, but the daemon can start and serve the store.
            if let Err(e) = daemon::find_llama_server(&loaded.config.runner.llama_server) {
                let _ = writeln!(std::io::stderr(), "corrald: warning: {e}");
            }
            // Nor is a missing llama-fit-params: loads are then planned with the estimate.
            if let Err(e) = corral::projection::locate(&loaded.config.runner, std::env::var_os("PATH").as_deref()) {
                let _ = writeln!(std::io::stderr(), "corrald: warning: {e}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "corrald: invalid configuration: {e}");
            ExitCode::from(EX_CONFIG)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:1: {source}")]
    struct Bind {
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_named_once() {
        let in_use = || std::io::Error::from(std::io::ErrorKind::AddrInUse);
        // The error names its source in its own message: the source is not repeated.
        let e = anyhow::Error::new(Bind { source: in_use() }).context("serving");
        assert_eq!(describe(&e), format!("serving: cannot listen on 127.0.0.1:1: {}", in_use()));
        // A context that does not name its cause is followed by it.
        let e = anyhow::Error::new(in_use()).context("cannot open the store");
        assert_eq!(describe(&e), format!("cannot open the store: {}", in_use()));
    }
}
