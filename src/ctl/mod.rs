//! `corralctl`, the command-line client: D-Bus commands against corrald's
//! `org.corral.Corral1`, and `run`, a chat over the HTTP API.
//!
//! - [`cli`]: the command line (clap), no logic;
//! - [`bus`]: the connection and proxies; [`error`]: every failure's message and exit code;
//! - [`commands`]: list, ps, show, load, unload, pull, push, create, cp, rm, status;
//! - [`job`]: following a job to its end, with a progress bar;
//! - [`modelfile`]: a Modelfile's relative paths made absolute before it is sent;
//! - [`chat`]: the HTTP API (TCP or a UNIX socket): chat turns, show, pull, blob uploads;
//!   [`host`]: where the API is (`--host`, `CORRAL_HOST`, `OLLAMA_HOST`);
//! - [`repl`]: `run`'s conversation: multi-line input, `/` commands, Ctrl-C;
//! - [`top`]: the live full-screen view;
//! - [`output`]: tables, units, JSON.

pub mod bus;
pub mod chat;
pub mod cli;
pub mod commands;
pub mod completion;
pub mod error;
pub mod host;
pub mod job;
pub mod modelfile;
pub mod output;
pub mod repl;
pub mod top;

#[cfg(test)]
mod man;

use std::path::PathBuf;

use clap::CommandFactory;

use self::bus::{Access, Bus, Choice};
use self::cli::{Cli, Command};
use self::commands::Style;
use self::error::CtlError;

/// What the command reads from its surroundings, passed in rather than looked up.
#[derive(Debug, Clone)]
pub struct Env {
    /// Whether standard output is a terminal.
    pub terminal: bool,
    /// The home directory, for `~/` in a Modelfile.
    pub home: Option<PathBuf>,
    /// `CORRAL_HOST`: where the HTTP API is, before `OLLAMA_HOST`.
    pub corral_host: Option<String>,
    /// `OLLAMA_HOST`, read as Ollama's clients read it.
    pub ollama_host: Option<String>,
}

/// Runs the command `cli` names.
pub async fn execute(cli: Cli, env: &Env) -> Result<(), CtlError> {
    let style = Style { json: cli.json, terminal: env.terminal };
    let choice = match (cli.session, cli.system) {
        (true, _) => Choice::Session,
        (_, true) => Choice::System,
        _ => Choice::Auto,
    };
    match cli.command {
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "corralctl", &mut script);
            output::print(&completion::with_model_names(shell, &String::from_utf8_lossy(&script)))
        }
        Command::Run(args) => {
            let format = args.format.map(|f| serde_json::from_str(&f).unwrap_or(serde_json::Value::String(f)));
            let chat = chat::Chat {
                api: chat::Api {
                    host: host::Host::resolve(
                        args.host.as_deref(),
                        env.corral_host.as_deref(),
                        env.ollama_host.as_deref(),
                    )?,
                    token: args.token,
                },
                model: args.model,
                json: cli.json,
                options: args.options.into_iter().collect(),
                format,
                keep_alive: args.keepalive,
                verbose: args.verbose,
                system: None,
                history: Vec::new(),
            };
            repl::run(chat, args.prompt.as_deref(), args.insecure).await
        }
        Command::Top(args) => top::run(top::Options { once: args.once, json: cli.json, bus: choice }).await,
        command => {
            let bus = Bus::connect(choice, access(&command)).await?;
            match command {
                Command::List { quiet: true } => commands::names(&bus).await,
                Command::List { quiet: false } => commands::list(&bus, style).await,
                Command::Ps => commands::ps(&bus, style).await,
                Command::Show { model, modelfile } => commands::show(&bus, style, &model, modelfile).await,
                Command::Load(args) => commands::load(&bus, style, &args).await,
                Command::Unload { model } => commands::unload(&bus, style, &model).await,
                Command::Pull(args) => commands::transfer(&bus, style, false, &args).await,
                Command::Push(args) => commands::transfer(&bus, style, true, &args).await,
                Command::Create { model, file, host, token } => {
                    let host =
                        host::Host::resolve(host.as_deref(), env.corral_host.as_deref(), env.ollama_host.as_deref())?;
                    let api = chat::Api { host, token };
                    commands::create(&bus, style, &model, &file, env.home.as_deref(), &api).await
                }
                Command::Cp { source, destination } => commands::copy(&bus, style, &source, &destination).await,
                Command::Rm { models } => commands::remove(&bus, style, &models).await,
                Command::Status => commands::status(&bus, style).await,
                Command::Completions { .. } | Command::Run(_) | Command::Top(_) => unreachable!("handled above"),
            }
        }
    }
}

/// Whether `command` only reads (and must not start corrald) or changes something.
fn access(command: &Command) -> Access {
    match command {
        Command::List { .. } | Command::Ps | Command::Show { .. } | Command::Status => Access::Read,
        _ => Access::Change,
    }
}
