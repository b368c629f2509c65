//! Command-line options of `corralctl`. No logic beyond defaults.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use clap_complete::Shell;

/// Controls corrald, the local language model manager, over D-Bus.
///
/// Over D-Bus, reading (list, ps, show, status) is open to every user; loading,
/// unloading and changing the store need root or membership of the group "corral". The
/// run command talks to the HTTP API instead, whose TCP port (127.0.0.1:11434) lets
/// every local user run models and, unless `[server] store_changes` says otherwise,
/// change the store too.
#[derive(Debug, Parser)]
#[command(name = "corralctl", version)]
pub struct Cli {
    /// Talk to the corrald of your user units, on your session bus. Without --user or
    /// --system: the session bus when corrald runs there or your user manager has its
    /// socket, else the system bus.
    #[arg(long = "user", visible_alias = "session", global = true, conflicts_with = "system")]
    pub session: bool,

    /// Talk to the system service, on the system bus.
    #[arg(long, global = true)]
    pub system: bool,

    /// Print machine-readable JSON instead of tables and progress.
    #[arg(long, global = true)]
    pub json: bool,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the models in the store.
    #[command(visible_alias = "ls")]
    List {
        /// Only the names, one a line (for scripts and shell completion).
        #[arg(short, long)]
        quiet: bool,
    },
    /// List the loaded models: state, process, where their memory is (device by device), expiry.
    Ps,
    /// Show one model's details and state.
    Show {
        /// The model's name, e.g. "tiny" or "me/model:tag".
        model: String,
        /// Print only a Modelfile that recreates the model (as `ollama show --modelfile`).
        #[arg(long)]
        modelfile: bool,
    },
    /// Load a model and wait until it is ready.
    Load(LoadArgs),
    /// Unload a model and wait until its processes are gone.
    #[command(visible_alias = "stop")]
    Unload {
        /// The model's name.
        model: String,
    },
    /// Pull a model from its registry, showing progress.
    Pull(TransferArgs),
    /// Push a model to the registry its name names, showing progress.
    Push(TransferArgs),
    /// Create (or replace) a model from a Modelfile; its FROM and ADAPTER files are passed
    /// open over D-Bus (read once, hashed as corrald copies them), so corrald needs no
    /// access to their paths; to a corrald that cannot take them, uploaded over the HTTP API.
    Create {
        /// The new model's name.
        model: String,
        /// The Modelfile; relative FROM and ADAPTER paths are taken from its directory.
        #[arg(short = 'f', long = "file", value_name = "MODELFILE", default_value = "Modelfile")]
        file: PathBuf,
        /// corrald's HTTP API, for uploads where files cannot be passed, as for `run`: without it `CORRAL_HOST`, else
        /// `OLLAMA_HOST`, else `http://127.0.0.1:11434`.
        #[arg(long, value_name = "URL|SOCKET")]
        host: Option<String>,
        /// A bearer token, for a daemon with `[server] api_tokens`.
        #[arg(long, env = "CORRAL_API_TOKEN", hide_env_values = true, value_name = "TOKEN")]
        token: Option<String>,
    },
    /// Copy a model to a new name (blobs are shared).
    Cp {
        /// The model to copy.
        source: String,
        /// The new name.
        destination: String,
    },
    /// Delete models (their runners unload first).
    Rm {
        /// The models' names.
        #[arg(required = true)]
        models: Vec<String>,
    },
    /// Show the daemon's version, devices (memory, usable, used), limits and what is loaded.
    Status,
    /// Watch devices, loaded models, the queue and events live, full screen (needs a terminal).
    ///
    /// Keys: up/down or k/j select a model, u unloads it (as unload does, with the same
    /// permission), ? shows help, q, Esc or Ctrl-C quit. Without a terminal it refuses;
    /// --once prints one snapshot instead.
    Top(TopArgs),
    /// Chat with a model over the HTTP API: one PROMPT, or lines from standard input.
    Run(RunArgs),
    /// Print a shell completion script.
    Completions {
        /// The shell.
        shell: Shell,
    },
}

/// `load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// The model's name.
    pub model: String,
    /// How long it stays loaded when idle: a duration such as "10m", or "-1" for forever.
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub keep_alive: Option<String>,
    /// Context length in tokens.
    #[arg(long, value_name = "TOKENS")]
    pub num_ctx: Option<i64>,
    /// Layers to offload to GPUs.
    #[arg(long, value_name = "LAYERS")]
    pub num_gpu: Option<i64>,
}

/// `top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// Print one snapshot as text (with --json, as JSON) and exit; needs no terminal.
    #[arg(long)]
    pub once: bool,
}

/// `pull` and `push`.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// The model's name, with its registry, e.g. "registry.example.org/me/model:tag".
    pub model: String,
    /// Allow plain HTTP to the registry.
    #[arg(long)]
    pub insecure: bool,
}

/// `run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The model's name.
    pub model: String,
    /// The message to send; without it, a conversation: at a terminal a prompt, else each
    /// line of standard input is one turn. `"""` opens a message of several lines, `/?`
    /// lists the commands (`/bye`, `/set`, `/show`, `/clear`, `/load`); Ctrl-C stops a reply.
    /// A model the store lacks is pulled first, as `ollama run` does.
    pub prompt: Option<String>,
    /// Show timings after each reply: durations, token counts and rates.
    #[arg(long)]
    pub verbose: bool,
    /// The reply's format: `json`, or a JSON schema.
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,
    /// How long the model stays loaded after the conversation: a duration such as "10m",
    /// "0" to unload at once, "-1" for forever.
    #[arg(long, visible_alias = "keep-alive", value_name = "DURATION", allow_hyphen_values = true)]
    pub keepalive: Option<String>,
    /// Allow plain HTTP to the registry when the model is pulled.
    #[arg(long)]
    pub insecure: bool,
    /// corrald's HTTP API, read as Ollama reads `OLLAMA_HOST`: `[http://]HOST[:PORT][/PATH]`
    /// (port 11434 without a scheme; `0.0.0.0` is this machine), or a UNIX socket path such
    /// as /run/corral.sock. Without it: `CORRAL_HOST`, else `OLLAMA_HOST`, else
    /// `http://127.0.0.1:11434`.
    #[arg(long, value_name = "URL|SOCKET")]
    pub host: Option<String>,
    /// A model option for the request, such as `num_predict=64` or `temperature=0.2`
    /// (repeatable; the value is read as JSON when it parses, else as a string).
    #[arg(short = 'o', long = "option", value_name = "KEY=VALUE", value_parser = parse_option)]
    pub options: Vec<(String, serde_json::Value)>,
    /// A bearer token, for a daemon with `[server] api_tokens`.
    #[arg(long, env = "CORRAL_API_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    pub token: Option<String>,
}

/// `KEY=VALUE`, the value as JSON when it parses (`8`, `0.5`, `true`, `["a"]`), else a string.
fn parse_option(text: &str) -> Result<(String, serde_json::Value), String> {
    let (key, value) = text.split_once('=').ok_or_else(|| format!("expected KEY=VALUE, not \"{text}\""))?;
    if key.is_empty() {
        return Err(format!("expected KEY=VALUE, not \"{text}\""));
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
    Ok((key.to_owned(), value))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::{Cli, parse_option};

    #[test]
    fn options_are_json_values_or_strings() {
        assert_eq!(parse_option("num_predict=8"), Ok(("num_predict".into(), serde_json::json!(8))));
        assert_eq!(parse_option("stop=[\"a\"]"), Ok(("stop".into(), serde_json::json!(["a"]))));
        assert_eq!(parse_option("x=hello world"), Ok(("x".into(), serde_json::json!("hello world"))));
        assert!(parse_option("novalue").is_err());
        assert!(parse_option("=1").is_err());
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }
}
