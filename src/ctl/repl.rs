//! `run`'s conversation as `ollama run` has it: `"""` opens a message of several lines,
//! commands starting with `/` are corralctl's (never sent to the model), and on a
//! terminal Ctrl-C ends the reply being written, not the session (a second Ctrl-C at the
//! prompt, Ctrl-D or `/bye` end that).
//!
//! The terminal stays in its own line mode (its editing keys: Ctrl-U, Ctrl-W, erase);
//! reading is done on a thread so that the runtime can wait for a reply and a Ctrl-C at once.

use std::io::{BufRead, IsTerminal, Write};

use tokio::signal::unix::{Signal, SignalKind, signal};

use super::chat::{Chat, ensure_model};
use super::error::CtlError;

/// What a line of input asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing (an empty line).
    Nothing,
    /// More lines of a `"""` block are to come.
    More,
    /// A message for the model.
    Send(String),
    /// A new system message (`/set system`, in one line or a `"""` block).
    System(String),
    /// A command: its words.
    Command(Vec<String>),
}

/// The input read so far: an open `"""` block, if any.
#[derive(Debug, Default)]
pub struct Input {
    block: Option<(bool, String)>,
}

const QUOTES: &str = "\"\"\"";

impl Input {
    /// Whether a `"""` block is open (the prompt is `... `).
    #[must_use]
    pub fn open(&self) -> bool {
        self.block.is_some()
    }

    /// Drops an open block (Ctrl-C at the prompt).
    pub fn reset(&mut self) {
        self.block = None;
    }

    /// Reads one line (without its newline).
    pub fn feed(&mut self, line: &str) -> Step {
        if let Some((system, mut text)) = self.block.take() {
            // Inside a block every line is text, commands included, until a line ends in `"""`.
            if let Some(before) = line.strip_suffix(QUOTES) {
                text.push_str(before);
                return finish(system, text);
            }
            text.push_str(line);
            text.push('\n');
            self.block = Some((system, text));
            return Step::More;
        }
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix(QUOTES) {
            return self.open_block(false, rest);
        }
        if trimmed.starts_with('/') {
            let words: Vec<String> = trimmed.split_whitespace().map(str::to_owned).collect();
            if words.len() > 2 && words[0] == "/set" && words[1] == "system" {
                let text = trimmed["/set".len()..].trim_start()["system".len()..].trim_start();
                return match text.strip_prefix(QUOTES) {
                    Some(rest) => self.open_block(true, rest),
                    None => Step::System(text.to_owned()),
                };
            }
            return Step::Command(words);
        }
        if trimmed.is_empty() { Step::Nothing } else { Step::Send(trimmed.to_owned()) }
    }

    /// After an opening `"""`: the block is whole when `rest` ends with `"""` too.
    fn open_block(&mut self, system: bool, rest: &str) -> Step {
        if let Some(text) = rest.strip_suffix(QUOTES) {
            return finish(system, text.to_owned());
        }
        self.block = Some((system, format!("{rest}\n")));
        Step::More
    }
}

fn finish(system: bool, text: String) -> Step {
    match (system, text.trim().is_empty()) {
        (true, _) => Step::System(text),
        (false, true) => Step::Nothing,
        (false, false) => Step::Send(text),
    }
}

/// `run`: makes sure the model is there (pulling it as `ollama run` does), then one turn
/// with `prompt`, or a conversation read from standard input.
pub async fn run(mut chat: Chat, prompt: Option<&str>, insecure: bool) -> Result<(), CtlError> {
    ensure_model(&chat.api, &chat.model, insecure).await?;
    if let Some(prompt) = prompt {
        chat.turn(prompt).await?;
        return Ok(());
    }
    let interactive = std::io::stdin().is_terminal();
    let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<std::io::Result<String>>(1);
    // Standard input blocks; a thread reads it so that the runtime does not.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if lines_tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    // Ctrl-C is caught only in a conversation at a terminal; elsewhere it ends corralctl.
    let mut interrupts = if interactive {
        Some(
            signal(SignalKind::interrupt())
                .map_err(|source| CtlError::Io { what: "catching Ctrl-C".into(), source })?,
        )
    } else {
        None
    };
    let mut input = Input::default();
    let mut interrupted = false;
    loop {
        if interactive {
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "{}", if input.open() { "... " } else { ">>> " });
            let _ = out.flush();
        }
        let line = tokio::select! {
            line = lines.recv() => line,
            () = interrupt(&mut interrupts) => {
                // The terminal dropped what was typed; a second Ctrl-C in a row ends it all.
                if input.open() {
                    input.reset();
                    say(interactive, "");
                } else if interrupted {
                    say(interactive, "");
                    return Ok(());
                } else {
                    say(interactive, "\nUse Ctrl + d or /bye to exit (or Ctrl + c again).");
                }
                interrupted = true;
                continue;
            }
        };
        interrupted = false;
        let Some(line) = line else {
            // End of input: Ctrl-D at a terminal.
            if interactive {
                say(interactive, "");
            }
            return Ok(());
        };
        let line = line.map_err(|source| CtlError::Io { what: "reading standard input".into(), source })?;
        match input.feed(&line) {
            Step::Nothing | Step::More => {}
            Step::System(text) => {
                chat.system = Some(text);
                say(interactive, "Set system message.");
            }
            Step::Command(words) => {
                if !command(&mut chat, &words, interactive).await? {
                    return Ok(());
                }
            }
            Step::Send(text) => {
                let result = tokio::select! {
                    result = chat.turn(&text) => Some(result),
                    () = interrupt(&mut interrupts) => None,
                };
                match result {
                    // Ctrl-C: the reply stops (its connection closes, which ends the generation)
                    // and the exchange is not kept.
                    None => say(interactive, "\n"),
                    Some(Ok(_)) => {}
                    // In a conversation, a failed turn is reported and the next line tried;
                    // without a terminal, a script wants the failure.
                    Some(Err(e)) if interactive => {
                        let _ = writeln!(std::io::stderr(), "error: {e}");
                    }
                    Some(Err(e)) => return Err(e),
                }
            }
        }
    }
}

/// The next Ctrl-C; never, when they are not caught.
async fn interrupt(signal: &mut Option<Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// A command's answer: on standard output at a terminal (as Ollama's), on standard error
/// otherwise, so that a script's output holds only replies.
fn say(interactive: bool, text: &str) {
    let _ = if interactive {
        writeln!(std::io::stdout().lock(), "{text}")
    } else {
        writeln!(std::io::stderr().lock(), "{text}")
    };
}

fn usage(text: &str) {
    let _ = write!(std::io::stderr().lock(), "{text}");
}

const USAGE: &str = "Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.

";

const USAGE_SET: &str = "Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats

";

const USAGE_SHOW: &str = "Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template

";

const USAGE_SHORTCUTS: &str = "Available keyboard shortcuts:
  Ctrl + u            Delete the line before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit corralctl (/bye)

";

const USAGE_PARAMETERS: &str = "Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter num_gpu <int>          The number of layers to send to the GPU
  /set parameter stop <string> <string> ...   Set the stop parameters

";

/// Runs a `/` command; `false` when the session ends.
async fn command(chat: &mut Chat, words: &[String], interactive: bool) -> Result<bool, CtlError> {
    let word = |i: usize| words.get(i).map(String::as_str);
    match word(0).unwrap_or_default() {
        "/bye" | "/exit" => return Ok(false),
        "/?" | "/help" => match word(1) {
            None => usage(USAGE),
            Some("set" | "/set") => usage(USAGE_SET),
            Some("show" | "/show") => usage(USAGE_SHOW),
            Some("shortcut" | "shortcuts") => usage(USAGE_SHORTCUTS),
            Some(other) => say(interactive, &format!("Unknown help topic '{other}'. Type /? for help")),
        },
        "/clear" => {
            chat.history.clear();
            say(interactive, "Cleared session context");
        }
        "/set" => set(chat, words, interactive),
        "/show" => show(chat, word(1), interactive).await?,
        "/load" => match words {
            [_, model] => {
                if chat.api.show(model).await?.is_some() {
                    model.clone_into(&mut chat.model);
                    chat.history.clear();
                    say(interactive, &format!("Loading model '{model}'"));
                } else {
                    say(interactive, &format!("Couldn't find model '{model}'"));
                }
            }
            _ => say(interactive, "Usage:\n  /load <modelname>"),
        },
        other => say(interactive, &format!("Unknown command '{other}'. Type /? for help")),
    }
    Ok(true)
}

fn set(chat: &mut Chat, words: &[String], interactive: bool) {
    let Some(what) = words.get(1) else {
        usage(USAGE_SET);
        return;
    };
    match what.as_str() {
        "verbose" => {
            chat.verbose = true;
            say(interactive, "Set 'verbose' mode.");
        }
        "quiet" => {
            chat.verbose = false;
            say(interactive, "Set 'quiet' mode.");
        }
        "format" => {
            if words.get(2).map(String::as_str) == Some("json") {
                chat.format = Some(serde_json::Value::String("json".into()));
                say(interactive, "Set format to 'json' mode.");
            } else {
                say(interactive, "Invalid or missing format. For 'json' mode use '/set format json'");
            }
        }
        "noformat" => {
            chat.format = None;
            say(interactive, "Disabled format.");
        }
        "parameter" => {
            let [_, _, key, values @ ..] = words else {
                usage(USAGE_PARAMETERS);
                return;
            };
            if values.is_empty() {
                usage(USAGE_PARAMETERS);
                return;
            }
            let value = if key == "stop" {
                serde_json::Value::Array(values.iter().map(|v| serde_json::Value::String(v.clone())).collect())
            } else {
                let text = values.join(" ");
                serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))
            };
            chat.options.insert(key.clone(), value);
            say(interactive, &format!("Set parameter '{key}' to '{}'", values.join(", ")));
        }
        "system" => usage(USAGE_SET),
        other => say(interactive, &format!("Unknown command '/set {other}'. Type /? for help")),
    }
}

async fn show(chat: &Chat, what: Option<&str>, interactive: bool) -> Result<(), CtlError> {
    use std::fmt::Write as _;
    let Some(what) = what else {
        usage(USAGE_SHOW);
        return Ok(());
    };
    let Some(model) = chat.api.show(&chat.model).await? else {
        say(interactive, &format!("Couldn't find model '{}'", chat.model));
        return Ok(());
    };
    let text = |key: &str| model.get(key).and_then(serde_json::Value::as_str).unwrap_or_default().to_owned();
    let out = match what {
        "info" => {
            let details = &model["details"];
            let mut lines = vec!["  Model".to_owned()];
            for (label, key) in [
                ("architecture", "family"),
                ("parameters", "parameter_size"),
                ("quantization", "quantization_level"),
                ("format", "format"),
            ] {
                if let Some(value) = details.get(key).and_then(serde_json::Value::as_str).filter(|v| !v.is_empty()) {
                    lines.push(format!("    {label:<16}{value}"));
                }
            }
            lines.join("\n") + "\n"
        }
        "license" => match text("license") {
            l if l.is_empty() => "No license was specified for this model.".to_owned(),
            l => l,
        },
        "modelfile" => text("modelfile"),
        "parameters" => {
            let mut out = String::from("Model defined parameters:\n");
            match text("parameters") {
                p if p.is_empty() => out.push_str("  No additional parameters were specified for this model.\n"),
                p => p.lines().for_each(|l| {
                    let _ = writeln!(out, "  {l}");
                }),
            }
            if !chat.options.is_empty() {
                out.push_str("\nUser defined parameters:\n");
                for (key, value) in &chat.options {
                    let _ = writeln!(out, "  {key:<30} {value}");
                }
            }
            out
        }
        "system" => match (&chat.system, text("system")) {
            (Some(system), _) => system.clone(),
            (None, s) if !s.is_empty() => s,
            (None, _) => "No system message was specified for this model.".to_owned(),
        },
        "template" => match text("template") {
            t if t.is_empty() => "No prompt template was specified for this model.".to_owned(),
            t => t,
        },
        other => format!("Unknown command '/show {other}'. Type /? for help"),
    };
    say(interactive, out.trim_end());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Input, Step};

    fn feed(lines: &[&str]) -> Vec<Step> {
        let mut input = Input::default();
        lines.iter().map(|l| input.feed(l)).collect()
    }

    #[test]
    fn triple_quotes_make_one_message_of_many_lines() {
        assert_eq!(
            feed(&["\"\"\"first", "/bye is text here", "", "last\"\"\"", "after"]),
            [
                Step::More,
                Step::More,
                Step::More,
                Step::Send("first\n/bye is text here\n\nlast".into()),
                Step::Send("after".into())
            ]
        );
        assert_eq!(feed(&["\"\"\"", "a", "\"\"\""]), [Step::More, Step::More, Step::Send("\na\n".into())]);
        assert_eq!(feed(&["\"\"\"one line\"\"\""]), [Step::Send("one line".into())]);
        assert_eq!(feed(&["  \"\"\"", "\"\"\""]), [Step::More, Step::Nothing]);
    }

    #[test]
    fn slash_commands_are_not_messages() {
        assert_eq!(feed(&["/?"]), [Step::Command(vec!["/?".into()])]);
        assert_eq!(feed(&["  /set  verbose "]), [Step::Command(vec!["/set".into(), "verbose".into()])]);
        assert_eq!(feed(&["/set system be brief"]), [Step::System("be brief".into())]);
        assert_eq!(feed(&["/set system \"\"\"two", "lines\"\"\""]), [Step::More, Step::System("two\nlines".into())]);
        assert_eq!(feed(&["", "   ", "hello  "]), [Step::Nothing, Step::Nothing, Step::Send("hello".into())]);
    }
}
