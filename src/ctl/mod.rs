//! `corralctl`, the command-line client: D-Bus commands against corrald's
//! `org.corral.Corral1`, and `run`, a chat over the HTTP API.
//!
//! - [`cli`]: the command line (clap), no logic;
//! - [`bus`]: the connection and proxies; [`error`]: every failure's message and exit code;
//! - [`commands`]: list, ps, show, load, unload, pull, push, create, cp, rm, status;
//! - [`job`]: following a job to its end, with a progress bar;
//! - [`modelfile`]: a Modelfile's relative paths made absolute before it is sent;
//! - [`chat`]: the HTTP API (TCP or a UNIX socket): chat turns, show, pull, blob uploads;
//! - [`repl`]: `run`'s conversation: multi-line input, `/` commands, Ctrl-C;
//! - [`output`]: tables, units, JSON.

pub mod bus;
pub mod chat;
pub mod cli;
pub mod commands;
pub mod error;
pub mod job;
pub mod modelfile;
pub mod output;
pub mod repl;

#[cfg(test)]
mod man;

use std::path::PathBuf;

use clap::CommandFactory;

use self::bus::Bus;
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
}

/// Runs the command `cli` names.
pub async fn execute(cli: Cli, env: &Env) -> Result<(), CtlError> {
    let style = Style { json: cli.json, terminal: env.terminal };
    match cli.command {
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "corralctl", &mut script);
            output::print(&String::from_utf8_lossy(&script))
        }
        Command::Run(args) => {
            let format = args.format.map(|f| serde_json::from_str(&f).unwrap_or(serde_json::Value::String(f)));
            let chat = chat::Chat {
                api: chat::Api { host: chat::Host::parse(&args.host)?, token: args.token },
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
        command => {
            let bus = Bus::connect(cli.session).await?;
            match command {
                Command::List => commands::list(&bus, style).await,
                Command::Ps => commands::ps(&bus, style).await,
                Command::Show { model } => commands::show(&bus, style, &model).await,
                Command::Load(args) => commands::load(&bus, style, &args).await,
                Command::Unload { model } => commands::unload(&bus, style, &model).await,
                Command::Pull(args) => commands::transfer(&bus, style, false, &args).await,
                Command::Push(args) => commands::transfer(&bus, style, true, &args).await,
                Command::Create { model, file, host, token } => {
                    let api = chat::Api { host: chat::Host::parse(&host)?, token };
                    commands::create(&bus, style, &model, &file, env.home.as_deref(), &api).await
                }
                Command::Cp { source, destination } => commands::copy(&bus, style, &source, &destination).await,
                Command::Rm { models } => commands::remove(&bus, style, &models).await,
                Command::Status => commands::status(&bus, style).await,
                Command::Completions { .. } | Command::Run(_) => unreachable!("handled above"),
            }
        }
    }
}
