//! corral: a systemd-native manager for local large language models.
//!
//! `corrald` serves an Ollama- and OpenAI-compatible HTTP API on the sockets systemd
//! passes it, and runs each loaded model as an upstream llama.cpp `llama-server`
//! child.  See ARCHITECTURE.md for the code map and the invariants.

pub mod cli;
pub mod config;
pub mod ctl;
pub mod daemon;
pub mod dbus;
pub mod demo_model;
pub mod durations;
pub mod gguf;
pub mod gpu;
pub mod http;
pub mod logging;
pub mod paths;
pub mod program;
pub mod projection;
pub mod prompt_template;
pub mod redact;
pub mod scheduler;
pub mod state_file;
pub mod store;
pub mod supervisor;
pub mod sync;
pub mod systemd;
pub mod units;
pub mod workers;

/// corral's own version: in the journal's first entry, `corral_version` on `/api/version`,
/// the `X-Corral-Version` header of every answer and D-Bus' `Version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
