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
        let line = format!("{command}; echo \"[exited $?]\"; sleep 3600");
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
    assert!(out.status.success(), "corralctl {}: {}\ncorrald:\n{}", args.join(" "), describe(&out), rig.corrald.stderr());
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
        rest.strip_prefix("▏ ")?
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
