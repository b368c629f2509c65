//! Command-line options of `corrald`. No logic beyond defaults.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::config::ConfigSource;
use crate::paths::Paths;

/// corrald: serves local language models through llama.cpp's llama-server.
#[derive(Debug, Parser)]
#[command(name = "corrald", version, about)]
pub struct Cli {
    /// Read this file (and its PATH.d/*.toml drop-ins) instead of corral.toml in the configuration directory.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Check the configuration, print the files read, and exit: 0 when valid, 78 otherwise.
    #[arg(long)]
    pub check_config: bool,

    /// Run as a user service (what the user units pass): serve D-Bus on the session bus
    /// unless `[dbus] bus` says otherwise.
    #[arg(long)]
    pub user: bool,

    /// Write corral's tiny demo model (a few hundred KB of random weights, for trying things
    /// out) to PATH and exit.
    #[arg(long, value_name = "PATH")]
    pub write_demo_model: Option<PathBuf>,

    /// Where logs go: the journal when stderr is connected to it (auto), or always one of them.
    #[arg(long, value_enum, default_value_t = LogTarget::Auto)]
    pub log_target: LogTarget,
}

/// Where the daemon logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogTarget {
    /// The journal when systemd connected stderr to it, else stderr.
    Auto,
    /// The journal's native protocol, with structured fields.
    Journal,
    /// Human-readable lines on stderr.
    Stderr,
}

impl Cli {
    /// The layer under the configuration files: `[dbus] bus = "session"` for `--user`.
    #[must_use]
    pub fn config_base(&self) -> toml::Table {
        let mut base = toml::Table::new();
        if self.user {
            let mut dbus = toml::Table::new();
            dbus.insert("bus".into(), toml::Value::String("session".into()));
            base.insert("dbus".into(), toml::Value::Table(dbus));
        }
        base
    }

    /// The configuration to load: `--config PATH` (which must exist) or the default file (which may not).
    #[must_use]
    pub fn config_source(&self, paths: &Paths) -> ConfigSource {
        match &self.config {
            Some(file) => ConfigSource { file: file.clone(), required: true },
            None => ConfigSource { file: paths.config_file(), required: false },
        }
    }
}
