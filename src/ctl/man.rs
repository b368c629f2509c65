//! `packaging/man/corralctl.1` is generated from the command line with `clap_mangen`, plus
//! hand-written sections, and checked in; this test keeps it in step with the CLI.
//! After changing the CLI: `CORRAL_BLESS_MAN=1 cargo test ctl::man` rewrites it.

use std::fmt::Write as _;
use std::path::Path;

use clap::CommandFactory;

use super::cli::Cli;

/// Sections clap knows nothing about, in roff.
const EXTRA: &str = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Success (also \fBunload\fR of a stored model that is not loaded: it says so).
.TP
\fB1\fR
The command failed: corrald's own error (an unknown model, a bad name, a failed load or
job), or a local one (an unreadable Modelfile).
.TP
\fB2\fR
Bad usage: unknown options or missing arguments.
.TP
\fB69\fR
corrald cannot be reached (EX_UNAVAILABLE): it is not running (the message says why when
the service manager knows: masked, a rejected configuration, the socket's start limit),
not on the bus asked for, or the bus itself cannot be reached; for \fBrun\fR, its HTTP API
does not answer. Reading (\fBlist\fR, \fBps\fR, \fBshow\fR, \fBstatus\fR) never starts
corrald; the other commands start it by bus activation when it is stopped.
.TP
\fB75\fR
A temporary failure (EX_TEMPFAIL): corrald is too busy for the request (its queue of
loads is full, or as many store jobs run as it allows) or is stopping; the same command
may work later.
.TP
\fB77\fR
Permission denied (EX_NOPERM): the bus policy allows loading, unloading and changing
models only to root and members of the group \fBcorral\fR.
.SH ENVIRONMENT
.TP
\fBDBUS_SYSTEM_BUS_ADDRESS\fR
The system bus to use instead of the standard socket.
.TP
\fBDBUS_SESSION_BUS_ADDRESS\fR
The session bus (else \fI$XDG_RUNTIME_DIR/bus\fR), where the user units' corrald serves.
.TP
\fBCORRAL_HOST\fR
For \fBrun\fR and \fBcreate\fR (its uploads), when \fB\-\-host\fR is not given: corrald's HTTP API, read as Ollama reads
\fBOLLAMA_HOST\fR: [http://]HOST[:PORT][/PATH], port 11434 without a scheme (80 with
http://), 0.0.0.0 meaning this machine; or a UNIX socket path such as /run/corral.sock
(or unix:PATH). A value that does not parse is an error naming the variable.
.TP
\fBOLLAMA_HOST\fR
For \fBrun\fR and \fBcreate\fR (its uploads), when neither \fB\-\-host\fR nor \fBCORRAL_HOST\fR is set: the same, so
that a shell set up for Ollama reaches corrald. Without any, http://127.0.0.1:11434.
.TP
\fBCORRAL_API_TOKEN\fR
For \fBrun\fR and \fBcreate\fR: a bearer token, when the daemon is configured with api_tokens.
.SH EXAMPLES
.nf
corralctl list
corralctl pull registry.example.org/me/model:q4
corralctl create mine \-f ./Modelfile
corralctl load mine \-\-keep\-alive 1h
corralctl run mine "Why is the sky blue?"
corralctl \-\-json ps
corralctl top
corralctl top \-\-once
corralctl completions bash > /etc/bash_completion.d/corralctl
.fi
.SH "RUN AT A TERMINAL"
As \fBollama run\fR: a model the store lacks is pulled first (its progress on standard
error). At the \fB>>>\fR prompt, a line starting with \fB"""\fR begins a message of
several lines, ended by a line ending with \fB"""\fR. Lines starting with \fB/\fR are
commands, never sent to the model: \fB/?\fR or \fB/help\fR, \fB/set verbose\fR,
\fB/set quiet\fR, \fB/set format json\fR, \fB/set noformat\fR,
\fB/set parameter\fR \fIKEY VALUE\fR, \fB/set system\fR \fITEXT\fR,
\fB/show info|license|modelfile|parameters|system|template\fR, \fB/load\fR \fIMODEL\fR,
\fB/clear\fR, \fB/bye\fR. Ctrl-C stops the reply being written (the exchange is not
kept) and the conversation goes on; at the prompt, a second Ctrl-C in a row, Ctrl-D or
\fB/bye\fR ends it. Without a terminal, each line of standard input is a turn, with the
same \fB"""\fR blocks and commands.
.SH "SEE ALSO"
\fBcorrald\fR(8), \fBcorral.toml\fR(5), \fBsystemctl\fR(1), \fBbusctl\fR(1)
"#;

/// The manual page's text: clap's pages for the whole command, with the subcommands
/// described here in full (clap would only point at one page per subcommand).
fn render() -> String {
    let command = Cli::command();
    let man = clap_mangen::Man::new(command.clone()).section("1").manual("corral");
    let mut out = Vec::new();
    man.render_title(&mut out).expect("to memory");
    man.render_name_section(&mut out).expect("to memory");
    man.render_synopsis_section(&mut out).expect("to memory");
    man.render_description_section(&mut out).expect("to memory");
    man.render_options_section(&mut out).expect("to memory");
    let mut text = String::from_utf8(out).expect("roff is UTF-8");
    text.push_str(".SH COMMANDS\n");
    for sub in command.get_subcommands() {
        text.push_str(&subcommand(sub));
    }
    text.push_str(EXTRA);
    text
}

/// One subcommand: its synopsis, what it does, and its arguments.
fn subcommand(sub: &clap::Command) -> String {
    let mut synopsis = format!("\\fBcorralctl {}\\fR", sub.get_name());
    let mut args = String::new();
    for arg in sub.get_arguments().filter(|a| !a.is_hide_set() && !a.is_global_set()) {
        let value = arg
            .get_value_names()
            .and_then(|v| v.first())
            .map_or_else(|| arg.get_id().as_str().to_uppercase(), ToString::to_string);
        let (item, label) = match arg.get_long().map(escape) {
            Some(long) if arg.get_action().takes_values() => {
                (format!("\\-\\-{long} \\fI{value}\\fR"), format!("\\fB\\-\\-{long}\\fR \\fI{value}\\fR"))
            }
            Some(long) => (format!("\\-\\-{long}"), format!("\\fB\\-\\-{long}\\fR")),
            None => (format!("\\fI{value}\\fR"), format!("\\fI{value}\\fR")),
        };
        let item = if arg.is_required_set() { item } else { format!("[{item}]") };
        let many = if matches!(arg.get_num_args(), Some(n) if n.max_values() > 1) { "..." } else { "" };
        let _ = write!(synopsis, " {item}{many}");
        if arg.get_id() == "help" {
            continue;
        }
        let help = arg.get_long_help().or_else(|| arg.get_help()).map(ToString::to_string).unwrap_or_default();
        let _ = write!(args, ".TP\n{label}\n{}\n", escape(&help));
    }
    let about = sub.get_long_about().or_else(|| sub.get_about()).map(ToString::to_string).unwrap_or_default();
    let aliases: Vec<&str> = sub.get_visible_aliases().collect();
    let aliases = if aliases.is_empty() { String::new() } else { format!(" (also: {})", aliases.join(", ")) };
    let mut out = format!(".TP\n{synopsis}\n{}{aliases}\n", escape(&about));
    if !args.is_empty() {
        let _ = write!(out, ".RS\n{args}.RE\n");
    }
    out
}

/// Text made safe for roff: backslashes and hyphens escaped, no line starting with a dot.
fn escape(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('-', "\\-")
        .lines()
        .map(|l| if l.starts_with(['.', '\'']) { format!("\\&{l}") } else { l.to_owned() })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_checked_in_man_page_matches_the_command_line() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/man/corralctl.1");
    let expected = render();
    if std::env::var_os("CORRAL_BLESS_MAN").is_some() {
        std::fs::write(&path, &expected).expect("write the man page");
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        actual == expected,
        "{} is out of date with the CLI: run `CORRAL_BLESS_MAN=1 cargo test ctl::man` and commit it",
        path.display()
    );
}
