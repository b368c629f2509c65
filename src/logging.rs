//! Logging setup: native journald fields under systemd, readable stderr otherwise.
//!
//! Journal entries carry `SYSLOG_IDENTIFIER=corrald` and every event field upper-cased
//! without a prefix, so `corral_event = "ready"` becomes `CORRAL_EVENT=ready`.
//! The level comes from `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::cli::LogTarget;

/// The journal's `SYSLOG_IDENTIFIER` for the daemon's own entries.
pub const SYSLOG_IDENTIFIER: &str = "corrald";

/// Installs the global subscriber. Returns the target actually used.
pub fn init(target: LogTarget, stderr_is_journal: bool) -> LogTarget {
    let filter = || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let want_journal = match target {
        LogTarget::Auto => stderr_is_journal,
        LogTarget::Journal => true,
        LogTarget::Stderr => false,
    };
    if want_journal {
        match tracing_journald::layer() {
            Ok(layer) => {
                let layer = layer.with_field_prefix(None).with_syslog_identifier(SYSLOG_IDENTIFIER.to_owned());
                tracing_subscriber::registry().with(filter()).with(layer).init();
                return LogTarget::Journal;
            }
            Err(e) => {
                init_stderr(filter());
                tracing::warn!(error = %e, "the journal is not reachable; logging to stderr");
                return LogTarget::Stderr;
            }
        }
    }
    init_stderr(filter());
    LogTarget::Stderr
}

fn init_stderr(filter: EnvFilter) {
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into files or pipes.
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false)
        .init();
}
