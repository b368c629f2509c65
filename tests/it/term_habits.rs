//! `corralctl` at the keyboard, as Ollama's users know it, in a real terminal (tmux: keys
//! sent, the screen read back): pull and push progress, `run`'s conversation, `create`
//! from a file corrald cannot read.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::container::{describe, output_within, poll_until};
use crate::support::dbus::BusDaemon;
use crate::support::registry::DockerRegistry;

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const WAIT: Duration = Duration::from_secs(90);

/// A tmux server of its own (its own socket), one window running a command whose exit
/// status is printed after it, as `[exited N]`, the pane kept.
struct Tmux {
    dir: tempfile::TempDir,
}

impl Tmux {
    /// Starts `command` (a shell line) in an 100×30 terminal with `env`.
    fn start(command: &str, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        // The shell outlives a Ctrl-C meant for the command (a trap that runs a command,
        // unlike one that ignores the signal, is reset in the command).
        let line = format!("trap : INT; {command}; echo \"[exited $?]\"; sleep 3600");
        let mut cmd = Command::new("tmux");
        cmd.arg("-S").arg(dir.path().join("tmux.sock"));
        cmd.args(["-f", "/dev/null", "new-session", "-d", "-x", "100", "-y", "30", "sh", "-c", &line]);
        cmd.env_remove("TMUX");
        for (key, value) in env {
            cmd.env(key, value);
        }
        let out = output_within(&mut cmd, WAIT);
        assert!(out.status.success(), "tmux new-session: {}", describe(&out));
        Self { dir }
    }

    fn tmux(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = Command::new("tmux");
        cmd.arg("-S").arg(self.dir.path().join("tmux.sock")).args(args);
        output_within(&mut cmd, WAIT)
    }

    /// Types `keys` (tmux key names: `Enter`, `C-c`, or literal text).
    fn send(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "0"];
        args.extend_from_slice(keys);
        let out = self.tmux(&args);
        assert!(out.status.success(), "tmux send-keys: {}", describe(&out));
    }

    /// Types `text` literally, then Enter.
    fn line(&self, text: &str) {
        self.send(&["-l", text]);
        self.send(&["Enter"]);
    }

    /// The screen and its scrollback, lines without trailing blanks.
    fn screen(&self) -> String {
        let out = self.tmux(&["capture-pane", "-p", "-t", "0", "-S", "-1000"]);
        assert!(out.status.success(), "tmux capture-pane: {}", describe(&out));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
        lines.join("\n").trim_end().to_owned()
    }

    /// Waits until the screen satisfies `done`; returns it.
    fn wait(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        poll_until(WAIT, what, || {
            let screen = self.screen();
            if done(&screen) { Ok(screen) } else { Err(screen) }
        })
    }

    /// Waits until the command ended; returns the screen.
    fn exited(&self) -> String {
        self.wait("the command to end", |s| s.contains("[exited "))
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

fn rig() -> BusDaemon {
    BusDaemon::start("[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n")
}

/// `corralctl ARGS` as root on the rig's bus; asserts success, returns stdout.
fn ctl(rig: &BusDaemon, args: &[&str]) -> String {
    let mut all = vec![CORRALCTL];
    all.extend_from_slice(args);
    let out = rig.bus.run_as(None, &all);
    assert!(
        out.status.success(),
        "corralctl {}: {}\ncorrald:\n{}",
        args.join(" "),
        describe(&out),
        rig.corrald.stderr()
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// A layer's finished line, `pulling 0123456789ab: 100% ▕██▏ 512 MiB` (without the bar
/// when `bar` is false); returns its 12 hex digits.
fn layer_line<'a>(line: &'a str, verb: &str, bar: bool) -> Option<&'a str> {
    let rest = line.strip_prefix(verb)?.strip_prefix(' ')?;
    let (hex, rest) = rest.split_at_checked(12)?;
    if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let rest = rest.strip_prefix(": 100% ")?;
    let size = if bar {
        let rest = rest.strip_prefix('▕')?.trim_start_matches('█');
        rest.strip_prefix("▏ ")?.trim_start()
    } else {
        rest
    };
    let (number, unit) = size.split_once(' ')?;
    (number.parse::<f64>().is_ok() && ["B", "KiB", "MiB", "GiB"].contains(&unit)).then_some(hex)
}

/// The 12-digit names of the layers a model's manifest lists (with its config).
fn layers(rig: &BusDaemon, model: &str) -> Vec<String> {
    let manifests = rig.path().join("models/manifests");
    let file = find_file(&manifests, model.rsplit_once(':').map_or(model, |(_, tag)| tag)).expect("the manifest");
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(file).expect("read")).expect("JSON");
    let mut digests: Vec<String> = manifest["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .chain(std::iter::once(&manifest["config"]))
        .map(|l| l["digest"].as_str().expect("digest")["sha256:".len()..][..12].to_owned())
        .collect();
    digests.sort();
    digests
}

fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

#[test]
fn pull_and_push_show_one_line_per_layer_and_success_like_ollama() {
    let rig = rig();
    let registry = DockerRegistry::start();
    let remote = format!("{}/me/chat:7", registry.host());
    ctl(&rig, &["cp", "chat", &remote]);
    let expected = layers(&rig, &remote);
    assert!(expected.len() >= 2, "{expected:?}");

    // Plain HTTP without --insecure: the failure says what to do, not a TLS record type.
    let mut all = vec![CORRALCTL, "push", remote.as_str()];
    let out = rig.bus.run_as(None, &all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stderr.contains("answered in plain HTTP") && stderr.contains("--insecure"), "{}", describe(&out));
    assert!(!stderr.contains("InvalidContentType"), "{}", describe(&out));

    // Not a terminal: plain lines, one per step and per layer, no escape codes.
    all.push("--insecure");
    let out = rig.bus.run_as(None, &all);
    assert!(out.status.success(), "{}", describe(&out));
    let plain = String::from_utf8(out.stdout).expect("utf-8");
    assert!(!plain.contains('\x1b') && !plain.contains('\r'), "{plain:?}");
    assert!(plain.ends_with("success\n"), "{plain:?}");
    let mut pushed: Vec<&str> = plain.lines().filter_map(|l| layer_line(l, "pushing", false)).collect();
    pushed.sort_unstable();
    assert_eq!(pushed, expected, "one line per layer: {plain}");
    assert!(plain.lines().any(|l| l == "pushing manifest"), "{plain}");

    // On a terminal: a bar per layer, each line kept, the steps as lines, `success` last
    // with its newline (the shell's next line starts below it).
    ctl(&rig, &["rm", &remote]);
    let address = rig.bus.address().to_owned();
    let term = Tmux::start(&format!("{CORRALCTL} pull {remote} --insecure"), &[("DBUS_SYSTEM_BUS_ADDRESS", &address)]);
    let screen = term.exited();
    let lines: Vec<&str> = screen.lines().collect();
    assert!(lines.ends_with(&["success", "[exited 0]"]), "{screen}");
    let mut pulled: Vec<&str> = lines.iter().filter_map(|l| layer_line(l, "pulling", true)).collect();
    pulled.sort_unstable();
    assert_eq!(pulled, expected, "one finished bar per layer: {screen}");
    for step in ["pulling manifest", "verifying sha256 digest", "writing manifest"] {
        assert_eq!(lines.iter().filter(|l| **l == step).count(), 1, "{step}: {screen}");
    }
    let steps: Vec<usize> = ["pulling manifest", "verifying sha256 digest", "writing manifest", "success"]
        .iter()
        .map(|s| lines.iter().position(|l| l == s).expect("a step"))
        .collect();
    assert!(steps.is_sorted(), "steps out of order: {screen}");
    assert_eq!(rig.bus.run_as(None, &[CORRALCTL, "show", &remote]).status.code(), Some(0));
}

/// `GET /api/ps` of the rig's corrald.
fn api_ps(rig: &BusDaemon) -> serde_json::Value {
    let out = output_within(Command::new("curl").args(["-sf", &format!("http://127.0.0.1:{}/api/ps", rig.port)]), WAIT);
    assert!(out.status.success(), "{}", describe(&out));
    serde_json::from_slice(&out.stdout).expect("ps JSON")
}

/// The prompt is the screen's last line (an empty `>>> `, trimmed to `>>>`).
fn at_prompt(screen: &str) -> bool {
    screen.lines().last().is_some_and(|l| l == ">>>")
}

#[test]
fn run_at_a_terminal_handles_commands_multiline_input_and_verbose_like_ollama_run() {
    let rig = rig();
    let host = format!("http://127.0.0.1:{}", rig.port);
    let term = Tmux::start(
        &format!("{CORRALCTL} run chat --host {host} -o num_predict=6 --verbose --keepalive 7m"),
        &[("DBUS_SYSTEM_BUS_ADDRESS", rig.bus.address())],
    );
    term.wait("the prompt", at_prompt);

    // `/?` and `/set` are corralctl's: answered at once, nothing sent to the model (so nothing loaded).
    term.line("/?");
    let screen = term.wait("the help", |s| s.contains("Use \"\"\" to begin a multi-line message.") && at_prompt(s));
    assert!(screen.contains("/set") && screen.contains("/bye") && screen.contains("/clear"), "{screen}");
    term.line("/help set");
    term.wait("help for /set", |s| s.contains("/set verbose") && at_prompt(s));
    term.line("/set format json");
    term.wait("format json", |s| s.contains("Set format to 'json' mode.") && at_prompt(s));
    term.line("/set quiet");
    term.wait("quiet", |s| s.contains("Set 'quiet' mode.") && at_prompt(s));
    term.line("/set verbose");
    term.wait("verbose", |s| s.contains("Set 'verbose' mode.") && at_prompt(s));
    term.line("/nonsense");
    term.wait("an unknown command", |s| s.contains("Unknown command '/nonsense'. Type /? for help") && at_prompt(s));
    assert_eq!(api_ps(&rig)["models"], serde_json::json!([]), "a command reached the model:\n{}", term.screen());

    // `"""` opens one message of several lines: the continuation prompt, then one reply.
    term.line("\"\"\"Say");
    term.wait("the continuation prompt", |s| s.lines().last() == Some("..."));
    term.line("/bye is part of the message");
    term.line("hello\"\"\"");
    let screen = term.wait("the reply and its timings", |s| s.contains("eval rate:") && at_prompt(s));
    for label in ["total duration:", "load duration:", "prompt eval count:", "eval count:", "eval rate:"] {
        assert_eq!(
            screen.lines().filter(|l| l.starts_with(label)).count(),
            1,
            "{label} once, for one message:\n{screen}"
        );
    }
    assert!(screen.contains(" token(s)") && screen.contains(" tokens/s"), "{screen}");
    let total = screen.lines().find(|l| l.starts_with("total duration:")).expect("total");
    let value = total["total duration:".len()..].trim();
    assert!(value.ends_with(" ms") || value.ends_with(" s"), "a duration for people: {total}");

    // --keepalive reached the daemon: the model stays about 7 minutes.
    let ps = api_ps(&rig);
    let until = ps["models"][0]["expires_at"].as_str().expect("expires_at");
    let until = humantime::parse_rfc3339_weak(&until[..19]).expect("a time");
    let left = until.duration_since(std::time::SystemTime::now()).expect("in the future");
    assert!(left > Duration::from_secs(6 * 60) && left <= Duration::from_secs(8 * 60), "{left:?} {ps}");

    term.line("/clear");
    term.wait("clear", |s| s.contains("Cleared session context") && at_prompt(s));
    // Ctrl-D at an empty prompt ends the session.
    term.send(&["C-d"]);
    let screen = term.exited();
    assert!(screen.ends_with("[exited 0]"), "{screen}");
}

#[test]
fn ctrl_c_ends_the_reply_not_the_session() {
    // A runner that streams one token every 100 ms, without end: the reply is surely
    // being written when Ctrl-C comes.
    let rig = BusDaemon::with(
        "",
        Path::new(env!("CARGO_BIN_EXE_fake-llama-server")),
        "[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n",
    );
    let store = corral::store::Store::open(&rig.path().join("models")).expect("store");
    crate::support::api::fake_behaviour(&store, "chat", &serde_json::json!({ "stream_delay_ms": 100 }));

    let host = format!("http://127.0.0.1:{}", rig.port);
    let term = Tmux::start(
        &format!("{CORRALCTL} run chat --host {host} -o num_predict=-1"),
        &[("DBUS_SYSTEM_BUS_ADDRESS", rig.bus.address())],
    );
    term.wait("the prompt", at_prompt);
    term.line("count");
    term.wait("the reply to flow", |s| s.contains(" t3"));
    term.send(&["C-c"]);
    // The reply stops (the daemon's request ends) and the prompt is back.
    term.wait("the prompt after the reply", at_prompt);
    poll_until(WAIT, "the interrupted request to end", || {
        let out = rig.bus.run_as(None, &[CORRALCTL, "--json", "ps"]);
        let active: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}: {}", describe(&out)))?;
        if active[0]["active_requests"] == 0 { Ok(()) } else { Err(active.to_string()) }
    });

    // The session goes on: the next message gets its reply.
    term.line("again");
    term.wait("a second reply", |s| s.matches(" t3").count() >= 2);
    term.send(&["C-c"]);
    term.wait("the prompt after the second reply", at_prompt);
    // Ctrl-C at the prompt says how to leave; a second one leaves.
    term.send(&["C-c"]);
    term.wait("the hint", |s| s.contains("Use Ctrl + d or /bye to exit"));
    term.send(&["C-c"]);
    let screen = term.exited();
    assert!(screen.ends_with("[exited 0]"), "{screen}");
}

#[test]
fn run_pulls_a_model_the_store_lacks_as_ollama_run_does() {
    let rig = rig();
    let registry = DockerRegistry::start();
    let remote = format!("{}/me/chat:run", registry.host());
    ctl(&rig, &["cp", "chat", &remote]);
    ctl(&rig, &["push", &remote, "--insecure"]);
    ctl(&rig, &["rm", &remote]);

    let host = format!("http://127.0.0.1:{}", rig.port);
    let out =
        rig.bus.run_as(None, &[CORRALCTL, "run", &remote, "Hi", "--insecure", "-o", "num_predict=4", "--host", &host]);
    assert!(out.status.success(), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("pulling manifest\n") && stderr.contains("\nsuccess\n"), "{}", describe(&out));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("pulling"), "progress is not the reply: {}", describe(&out));
    ctl(&rig, &["show", &remote]);

    // A model that is nowhere: the error says both.
    let absent = format!("{}/me/absent:1", registry.host());
    let out = rig.bus.run_as(None, &[CORRALCTL, "run", &absent, "Hi", "--insecure", "--host", &host]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("model '{absent}' not found, and pulling it failed: ")), "{}", describe(&out));
}

#[test]
fn create_passes_a_file_corrald_cannot_see_and_stores_it_once() {
    let rig = rig();
    let source = rig.path().join("source.gguf");
    // Not the demo store's weights: a blob corrald does not have yet.
    let extra = vec![("corral.test".to_owned(), corral::gguf::GgufValue::U32(14))];
    std::fs::write(&source, corral::demo_model::tiny_llama_bytes_with(extra).expect("a GGUF")).expect("write");
    // The directory is a tmpfs in corralctl's own mount namespace: corrald, outside it,
    // sees an empty directory there (as ProtectHome= hides /home from it).
    let hidden = rig.path().join("hidden");
    std::fs::create_dir(&hidden).expect("mkdir");
    let host = format!("http://127.0.0.1:{}", rig.port);
    let create = |name: &str| {
        let script = format!(
            "mount -t tmpfs hidden {hidden} && cp {source} {hidden}/m.gguf && printf 'FROM ./m.gguf\\nSYSTEM hi\\n' > {hidden}/Modelfile \
             && cd / && {CORRALCTL} create {name} -f {hidden}/Modelfile --host {host}",
            hidden = hidden.display(),
            source = source.display(),
        );
        let out = rig.bus.run_as(None, &["unshare", "--mount", "--propagation", "private", "sh", "-c", &script]);
        assert!(out.status.success(), "{}\ncorrald:\n{}", describe(&out), rig.corrald.stderr());
        String::from_utf8(out.stdout).expect("utf-8")
    };
    assert!(std::fs::read_dir(&hidden).expect("the directory").next().is_none(), "corrald would see the file");

    // The file goes to corrald open (D-Bus CreateWithFiles), which copies it, hashing as it goes.
    let first = create("mine");
    assert!(first.lines().any(|l| l.starts_with("copying m.gguf: 100% ")), "copied: {first}");
    assert!(first.lines().any(|l| l.starts_with("creating new layer sha256:")), "{first}");
    assert!(first.ends_with("success\n"), "{first}");
    let shown = ctl(&rig, &["--json", "show", "mine"]);
    assert!(shown.contains("\"format\": \"gguf\"") || shown.contains("\"format\":\"gguf\""), "{shown}");

    // The same file again: corrald hashes it, finds the blob it has, and copies nothing.
    let second = create("mine2");
    assert!(second.lines().any(|l| l.starts_with("checking m.gguf: 100% ")), "checked: {second}");
    assert!(!second.lines().any(|l| l.starts_with("copying ")), "copied again: {second}");
    let weights = |out: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix("creating new layer ").or_else(|| l.strip_prefix("using existing layer ")))
            .map(str::to_owned)
    };
    assert!(second.lines().any(|l| l.starts_with("using existing layer sha256:")), "{second}");
    assert_eq!(weights(&second), weights(&first), "{second}");
    ctl(&rig, &["show", "mine2"]);
}

#[test]
fn run_takes_ollamas_flags_and_habits_without_a_terminal() {
    let rig = rig();
    let host = format!("http://127.0.0.1:{}", rig.port);
    let args = ["--json", "run", "chat", "Hi", "--format", "json", "--verbose", "--keepalive", "0"];
    let mut all = vec![CORRALCTL];
    all.extend_from_slice(&args);
    all.extend_from_slice(&["-o", "num_predict=8", "--host", &host]);
    let out = rig.bus.run_as(None, &all);
    assert!(out.status.success(), "{}", describe(&out));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let content = reply["message"]["content"].as_str().expect("content");
    assert!(content.trim_start().starts_with('{'), "--format json: {reply}");
    assert!(reply["total_duration"].as_u64().is_some_and(|n| n > 0), "--verbose: {reply}");
    assert!(reply["eval_count"].as_u64().is_some_and(|n| n > 0), "--verbose: {reply}");
    // --keepalive 0: unloaded once the reply is done.
    poll_until(WAIT, "the model to unload", || {
        let ps = api_ps(&rig);
        if ps["models"] == serde_json::json!([]) { Ok(()) } else { Err(ps.to_string()) }
    });

    // Piped: a `"""` block is one turn, commands answer on standard error, /bye ends.
    let script = format!(
        "printf '\"\"\"one\\ntwo\"\"\"\\n/set quiet\\n/bye\\nnever sent\\n' | {CORRALCTL} --json run chat -o num_predict=4 --host {host}"
    );
    let out = rig.bus.run_as(None, &["sh", "-c", &script]);
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("\"assistant\"").count(), 1, "one reply for the block: {}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Set 'quiet' mode."), "{}", describe(&out));
}
