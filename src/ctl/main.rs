//! `corralctl`: controls corrald over D-Bus. Exit codes: 0 success, 1 failure, 2 bad
//! usage, 69 corrald (or its bus) unreachable, 77 permission denied.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use corral::ctl::cli::Cli;
use corral::ctl::{Env, execute};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    let env = Env {
        terminal: std::io::stdout().is_terminal(),
        home: std::env::var_os("HOME").map(Into::into),
        corral_host: var("CORRAL_HOST"),
        ollama_host: var("OLLAMA_HOST"),
    };
    // One thread is plenty for one client, and keeps start-up light.
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "corralctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli, &env)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "corralctl: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
