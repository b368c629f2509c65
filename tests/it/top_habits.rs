//! `corralctl top` as people use it: in a real terminal (tmux, 80x24) against corrald on
//! a private bus with the shipped policy and the real llama-server. The screen follows a
//! load made elsewhere, `u` unloads (or says why it may not), `q` quits and leaves the
//! terminal as it was; without a terminal it refuses, and `--once` prints a snapshot.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::support::container::{describe, output_within, poll_until};
use crate::support::dbus::{BusDaemon, OUTSIDER};

const CORRALCTL: &str = env!("CARGO_BIN_EXE_corralctl");
const WAIT: Duration = Duration::from_secs(60);

/// A tmux server of its own (socket in a temporary directory) with one session running
/// one command in an 80x24 window; killed on drop.
struct Tmux {
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Tmux {
    /// Runs `command` (a shell line) in a detached `width`x`height` session; when it ends,
    /// the shell prints its exit status and the terminal's modes, then waits.
    fn start(width: u16, height: u16, bus_address: &str, command: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("corral-tmux-").tempdir().expect("tempdir");
        let socket = dir.path().join("tmux.sock");
        let tmux = Self { _dir: dir, socket };
        let line = format!("{command}; echo \"top exited $?\"; stty -a; exec sleep 3600");
        let (w, h) = (width.to_string(), height.to_string());
        let env = format!("DBUS_SYSTEM_BUS_ADDRESS={bus_address}");
        tmux.ok(&["new-session", "-d", "-x", &w, "-y", &h, "-e", &env, "sh", "-c", &line]);
        tmux
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("tmux");
        cmd.arg("-S").arg(&self.socket).args(args);
        cmd
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = output_within(&mut self.command(args), WAIT);
        assert!(out.status.success(), "tmux {}: {}", args.join(" "), describe(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The visible screen, one line per row.
    fn screen(&self) -> String {
        self.ok(&["capture-pane", "-p"])
    }

    /// A tmux format of the pane, e.g. `#{alternate_on}`.
    fn format(&self, format: &str) -> String {
        self.ok(&["display-message", "-p", format]).trim().to_owned()
    }

    fn keys(&self, keys: &str) {
        self.ok(&["send-keys", keys]);
    }

    /// Waits until the screen satisfies `ok`, and returns it.
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        poll_until(WAIT, what, || {
            let screen = self.screen();
            if ok(&screen) { Ok(screen) } else { Err(format!("\n{screen}")) }
        })
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = output_within(&mut self.command(&["kill-server"]), WAIT);
    }
}

fn rig() -> BusDaemon {
    BusDaemon::start("[scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n")
}

/// `corralctl --json ps` as root.
fn loaded(rig: &BusDaemon) -> serde_json::Value {
    let out = rig.bus.run_as(None, &[CORRALCTL, "--json", "ps"]);
    assert!(out.status.success(), "{}", describe(&out));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn load_chat(rig: &BusDaemon) {
    let out = rig.bus.run_as(None, &[CORRALCTL, "load", "chat", "--keep-alive", "10m"]);
    assert!(out.status.success(), "load: {}\ncorrald:\n{}", describe(&out), rig.corrald.stderr());
}

/// The screen's line that shows the model row for `name`.
fn row<'a>(screen: &'a str, name: &str) -> Option<&'a str> {
    screen.lines().find(|l| l.get(2..).is_some_and(|rest| rest.starts_with(name)))
}

#[test]
fn top_follows_a_load_unloads_with_u_and_quits_with_q_restoring_the_terminal() {
    let rig = rig();
    let tmux = Tmux::start(80, 24, rig.bus.address(), &format!("{CORRALCTL} top"));
    let first = tmux.wait_for("top's first screen", |s| s.contains("MODELS") && s.contains("no model is loaded"));
    assert!(first.lines().next().is_some_and(|l| l.starts_with("corrald ")), "{first}");
    assert!(first.lines().any(|l| l.starts_with("host ") && l.contains('░')), "a host memory bar:\n{first}");
    assert_eq!(tmux.format("#{alternate_on}"), "1", "top draws on the alternate screen");

    // A load made elsewhere shows up, signalled (the refresh alone would not add a row).
    load_chat(&rig);
    let screen = tmux.wait_for("the chat row, ready and selected", |s| {
        row(s, "chat:latest").is_some_and(|l| l.starts_with("> ") && l.contains("ready"))
    });
    let pid = loaded(&rig)[0]["pid"].as_u64().expect("a pid").to_string();
    let chat = row(&screen, "chat:latest").expect("row");
    // At 80 columns the pid column gives way to the speed (the load event names the pid).
    assert!(chat.contains("CPU"), "placement in the row: {chat}\n{screen}");
    assert!(screen.lines().any(|l| l.contains("NAME") && l.contains("TOK/S")), "{screen}");
    // ExpiresAt is not signalled: the once-a-second refresh brings it.
    tmux.wait_for("the time to unload", |s| row(s, "chat:latest").is_some_and(|l| l.contains(" in 9m ")));
    let screen = tmux.wait_for("the load event", |s| s.contains(&format!("loaded chat:latest (pid {pid})")));
    assert!(screen.lines().all(|l| l.chars().count() <= 80), "{screen}");

    // `?` shows the help; any key closes it.
    tmux.keys("?");
    tmux.wait_for("the help", |s| s.contains("unload the selected model"));
    tmux.keys("x");
    tmux.wait_for("the help closed", |s| !s.contains("unload the selected model"));

    tmux.keys("u");
    poll_until(WAIT, "chat unloaded over D-Bus", || {
        let ps = loaded(&rig);
        if ps == serde_json::json!([]) { Ok(()) } else { Err(ps.to_string()) }
    });
    let screen = tmux.wait_for("the unload on screen", |s| {
        s.contains("unloaded chat:latest: unload requested") && s.contains("no model is loaded")
    });
    assert!(row(&screen, "chat:latest").is_none(), "{screen}");

    tmux.keys("q");
    let after = tmux.wait_for("top to exit", |s| s.contains("top exited"));
    assert!(after.contains("top exited 0"), "{after}");
    assert_eq!(tmux.format("#{alternate_on}"), "0", "the alternate screen was left:\n{after}");
    assert_eq!(tmux.format("#{cursor_flag}"), "1", "the cursor is shown again");
    // Raw mode undone: `stty -a` (run after top) shows canonical input and echo back on.
    let modes: Vec<&str> = after.split(|c: char| c.is_whitespace() || c == ';').collect();
    for mode in ["icanon", "echo", "isig"] {
        assert!(modes.contains(&mode), "{mode:?} not restored:\n{after}");
    }
    assert!(!after.contains("MODELS"), "top's screen is gone:\n{after}");
}

#[test]
fn top_shows_a_refused_unload_in_its_status_line_and_quits_on_ctrl_c() {
    let rig = rig();
    load_chat(&rig);
    let command = format!("setpriv --reuid={OUTSIDER} --regid={OUTSIDER} --init-groups -- {CORRALCTL} top");
    // A large terminal this time: the bars carry their full text and what the device is.
    let tmux = Tmux::start(200, 50, rig.bus.address(), &command);
    let screen = tmux.wait_for("the chat row", |s| row(s, "chat:latest").is_some_and(|l| l.starts_with("> ")));
    let host = screen.lines().find(|l| l.starts_with("host ")).expect("a host bar");
    assert!(host.contains("corral ") && host.contains(" · other ") && host.contains(" · free "), "{screen}");
    assert!(host.trim_end().ends_with("corral may use 4.0 GiB"), "{screen}");
    assert!(host.chars().filter(|c| "█▓░".contains(*c)).count() >= 100, "the bar takes the width:\n{screen}");
    tmux.keys("u");
    let screen =
        tmux.wait_for("the refusal", |s| s.lines().nth(49).is_some_and(|l| l.starts_with("permission denied")));
    assert_eq!(loaded(&rig)[0]["state"], "ready", "a refused unload changed nothing:\n{screen}");
    assert!(row(&screen, "chat:latest").is_some_and(|l| l.contains("ready")), "{screen}");
    tmux.keys("C-c");
    let after = tmux.wait_for("top to exit", |s| s.contains("top exited"));
    assert!(after.contains("top exited 0"), "{after}");
    assert_eq!(tmux.format("#{alternate_on}"), "0");
}

#[test]
fn top_without_a_terminal_refuses_and_once_prints_a_snapshot() {
    let rig = rig();
    let out = rig.bus.run_as(None, &[CORRALCTL, "top"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs a terminal") && stderr.contains("corralctl top --once"), "{stderr}");
    assert!(out.stdout.is_empty(), "{}", describe(&out));

    load_chat(&rig);
    let out = rig.bus.run_as(None, &[CORRALCTL, "top", "--once"]);
    assert!(out.status.success(), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("corrald ") && text.contains("1 of "), "{text}");
    assert!(text.lines().any(|l| l.starts_with("host ")), "{text}");
    assert!(row(&text, "chat:latest").is_some_and(|l| l.contains("ready")), "{text}");
    assert!(text.lines().all(|l| l.chars().count() <= 80 && l == l.trim_end()), "{text}");
    assert!(!text.contains('\u{1b}'), "no escape sequences in a snapshot: {text:?}");

    let out = rig.bus.run_as(Some(OUTSIDER), &[CORRALCTL, "--json", "top", "--once"]);
    assert!(out.status.success(), "reading is open to everyone: {}", describe(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["models"][0]["name"], "chat:latest", "{json}");
    assert_eq!(json["models"][0]["state"], "ready", "{json}");
    assert_eq!(json["devices"][0]["label"], "host", "{json}");
    assert_eq!(json["version"], env!("CARGO_PKG_VERSION"), "{json}");
}

#[test]
fn top_reports_a_runner_that_crashed() {
    let rig = rig();
    let tmux = Tmux::start(80, 24, rig.bus.address(), &format!("{CORRALCTL} top"));
    tmux.wait_for("top's first screen", |s| s.contains("no model is loaded"));
    load_chat(&rig);
    tmux.wait_for("the chat row", |s| row(s, "chat:latest").is_some_and(|l| l.contains("ready")));
    let pid = loaded(&rig)[0]["pid"].as_u64().expect("a pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the runner");
    let screen = tmux.wait_for("the crash event", |s| s.contains("chat:latest crashed"));
    assert!(!screen.contains("failed to load"), "a crash is not a failed load:\n{screen}");

    // SIGTERM from elsewhere ends top as `q` does, the terminal restored.
    let shell = tmux.format("#{pane_pid}");
    let out = output_within(Command::new("pgrep").args(["-P", &shell]), WAIT);
    let top: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("top's pid");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(top), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let after = tmux.wait_for("top to exit", |s| s.contains("top exited"));
    assert!(after.contains("top exited 0"), "{after}");
    assert_eq!(tmux.format("#{alternate_on}"), "0", "the alternate screen was left:\n{after}");
    assert!(after.split_whitespace().any(|w| w == "icanon"), "raw mode undone:\n{after}");
}
