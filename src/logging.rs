//! Logging setup: native journald fields under systemd, readable stderr otherwise.
//!
//! Journal entries carry `SYSLOG_IDENTIFIER=corrald` and every event field upper-cased
//! without a prefix, so `corral_event = "ready"` becomes `CORRAL_EVENT=ready`.
//! The level comes from `RUST_LOG` (default `info`): a level, and `target=level` pairs,
//! comma-separated (`info,corral::scheduler=debug`). tracing's `Targets` reads it, not its
//! `EnvFilter`: that one also takes span and field filters, which a daemon's logs do not
//! need, and brings a regex engine into the binary (0.3 MB of code, and Unicode tables
//! where a test dependency's features turn them on: 0.4 MiB more resident at start in the
//! build `cargo bench` measures).

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::cli::LogTarget;

/// The journal's `SYSLOG_IDENTIFIER` for the daemon's own entries.
pub const SYSLOG_IDENTIFIER: &str = "corrald";

/// Installs the global subscriber. Returns the target actually used.
pub fn init(target: LogTarget, stderr_is_journal: bool) -> LogTarget {
    let (filter, refused) = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    let want_journal = match target {
        LogTarget::Auto => stderr_is_journal,
        LogTarget::Journal => true,
        LogTarget::Stderr => false,
    };
    // Warnings wait until a subscriber exists to take them.
    let (used, unreachable) = match want_journal.then(tracing_journald::layer) {
        Some(Ok(layer)) => {
            let layer = layer.with_field_prefix(None).with_syslog_identifier(SYSLOG_IDENTIFIER.to_owned());
            tracing_subscriber::registry().with(filter).with(layer).init();
            (LogTarget::Journal, None)
        }
        Some(Err(e)) => {
            init_stderr(filter);
            (LogTarget::Stderr, Some(e))
        }
        None => {
            init_stderr(filter);
            (LogTarget::Stderr, None)
        }
    };
    if let Some(e) = unreachable {
        tracing::warn!(error = %e, "the journal is not reachable; logging to stderr");
    }
    if let Some(why) = refused {
        tracing::warn!("{why}");
    }
    used
}

/// The filter `RUST_LOG`'s value asks for, else `info`; with why the value was refused.
fn log_filter(value: Option<&str>) -> (Targets, Option<String>) {
    let default = || Targets::new().with_default(LevelFilter::INFO);
    let Some(value) = value else { return (default(), None) };
    match value.parse::<Targets>() {
        Ok(filter) => (filter, None),
        Err(e) => (
            default(),
            Some(format!("RUST_LOG={value:?} is not a level and target=level pairs ({e}); logging at info")),
        ),
    }
}

fn init_stderr(filter: Targets) {
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into files or pipes.
    let ansi = std::io::stderr().is_terminal();
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).with_target(false);
    tracing_subscriber::registry().with(filter).with(layer).init();
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    use super::*;

    #[test]
    fn rust_log_takes_a_level_and_target_pairs_and_refuses_the_rest_naming_it() {
        let (filter, refused) = log_filter(None);
        assert!(refused.is_none());
        assert!(
            filter.would_enable("corral::scheduler", &Level::INFO) && !filter.would_enable("corral", &Level::DEBUG)
        );

        let (filter, refused) = log_filter(Some("warn,corral::daemon=debug,llama-server=trace"));
        assert!(refused.is_none());
        assert!(filter.would_enable("corral::daemon::start", &Level::DEBUG));
        assert!(!filter.would_enable("corral::scheduler", &Level::INFO));
        assert!(filter.would_enable("corral::scheduler", &Level::WARN));
        assert!(filter.would_enable("llama-server", &Level::TRACE));

        let (filter, refused) = log_filter(Some("off"));
        assert!(refused.is_none() && !filter.would_enable("corral", &Level::ERROR));

        // Span and field filters (EnvFilter's) and nonsense: `info`, and a warning naming the value.
        for bad in ["corral[load{model=x}]=debug", "corral=loud"] {
            let (filter, refused) = log_filter(Some(bad));
            let why = refused.expect("refused");
            assert!(why.starts_with(&format!("RUST_LOG={bad:?} is not a level and target=level pairs (")), "{why}");
            assert!(filter.would_enable("corral", &Level::INFO) && !filter.would_enable("corral", &Level::DEBUG));
        }
    }
}
