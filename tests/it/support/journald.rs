//! A real, private `systemd-journald` for one test (`tests/rig/journald-sandbox.sh`), and
//! helpers to read journal entries in `journalctl -o json` form.
//!
//! [`JournalSandbox::spawn`] runs a command in a private mount namespace where a standalone
//! journald serves the standard journal sockets, so a daemon that logs to "the journal" logs
//! there, and nowhere on the host.  The journal lives in a temporary directory and is read with
//! `journalctl --directory`, while the command runs or after it exited.  Dropping the sandbox
//! stops the command and journald (also when the test panics) and removes the directory.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use super::container::{output_within, poll_until, rig_script};

/// How long journald may take to come up and a command's PID to be known.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A command running next to its own journald; both are stopped on drop.
pub struct JournalSandbox {
    dir: tempfile::TempDir,
    child: Option<Child>,
    status: Option<ExitStatus>,
}

impl JournalSandbox {
    /// Starts journald in a private mount namespace and runs `program args…` there.
    pub fn spawn<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> Self {
        let dir = tempfile::Builder::new().prefix("corral-journal-").tempdir().expect("tempdir");
        let script = rig_script("journald-sandbox.sh");
        let mut state = OsString::from("STATE_DIRECTORY=");
        state.push(dir.path().join("state"));
        let mut runtime = OsString::from("RUNTIME_DIRECTORY=");
        runtime.push(dir.path().join("run"));
        let child = Command::new("bash")
            .arg(&script)
            .arg(dir.path())
            .arg("--")
            // The command (not journald, which reads these too) keeps its state in the
            // sandbox, never in /var/lib/corral; `env` execs it, so its PID stays the same.
            .arg("env")
            .args([state, runtime])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("sandbox.out")).expect("sandbox.out"))
            .stderr(std::fs::File::create(dir.path().join("sandbox.err")).expect("sandbox.err"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        Self { dir, child: Some(child), status: None }
    }

    /// The sandbox's directory: `journal/` holds the journal, `sandbox.err` the script's errors.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The journal directory, for `journalctl --directory`.
    pub fn journal_dir(&self) -> PathBuf {
        self.dir.path().join("journal")
    }

    /// The PID of the command (as the host sees it), once it has started.
    pub fn command_pid(&mut self) -> Pid {
        let file = self.dir.path().join("cmd.pid");
        let raw = poll_until(START_TIMEOUT, "the sandboxed command to start", || {
            if let Some(status) = self.try_status() {
                return Err(format!(
                    "the sandbox exited ({status}) before the command started: {}",
                    self.script_errors()
                ));
            }
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))
        });
        Pid::from_raw(raw.trim().parse().unwrap_or_else(|e| panic!("bad pid {raw:?} in {}: {e}", file.display())))
    }

    /// Sends `signal` to the command.
    pub fn signal(&mut self, signal: Signal) {
        let pid = self.command_pid();
        kill(pid, signal).unwrap_or_else(|e| panic!("cannot send {signal} to pid {pid}: {e}"));
    }

    /// Waits until the command has exited and the journal was synced; returns the command's status.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return status;
            }
            assert!(Instant::now() < deadline, "the sandboxed command did not exit within {timeout:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// All entries so far, parsed (`journalctl --directory DIR -o json -a`).
    pub fn entries(&self) -> Vec<Value> {
        let mut cmd = Command::new("journalctl");
        cmd.arg("--directory").arg(self.journal_dir()).args(["--no-pager", "-a", "-o", "json"]);
        let out = output_within(&mut cmd, Duration::from_secs(60));
        // Before journald created its first file, journalctl has nothing to read; that is "no entries".
        if !out.status.success() {
            return Vec::new();
        }
        parse_json_lines(&String::from_utf8_lossy(&out.stdout))
    }

    /// Waits until an entry matches `pred` and returns it.
    pub fn wait_for_entry(&self, timeout: Duration, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        poll_until(timeout, what, || {
            let entries = self.entries();
            entries
                .iter()
                .find(|e| pred(e))
                .cloned()
                .ok_or_else(|| format!("{} entries: {}", entries.len(), summary(&entries)))
        })
    }

    /// The sandbox script's stderr so far.
    pub fn script_errors(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sandbox.err")).unwrap_or_default()
    }

    /// The command's exit status once the sandbox has finished (non-blocking).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(child) = self.child.as_mut() {
                self.status = child.try_wait().expect("try_wait");
            }
        }
        self.status
    }
}

impl Drop for JournalSandbox {
    fn drop(&mut self) {
        if self.try_status().is_some() {
            return;
        }
        let Some(mut child) = self.child.take() else { return };
        // The script's trap stops the command and journald; if it does not finish in time,
        // everything it started is killed by PID.
        let _ = kill(Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("journald sandbox did not stop in time; killing it: {}", self.script_errors());
        for file in ["cmd.pid", "journald.pid"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.path().join(file)) {
                if let Ok(pid) = pid.trim().parse() {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Parses `journalctl -o json` output: one object per line.
pub fn parse_json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad journal JSON {l:?}: {e}")))
        .collect()
}

/// A field of a journal entry as text.  journalctl writes binary values as byte arrays and
/// repeated fields as arrays of values; those are decoded (lossily) or joined with newlines.
pub fn field(entry: &Value, name: &str) -> Option<String> {
    fn text(v: &Value) -> Option<String> {
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Array(items) if items.iter().all(Value::is_u64) => {
                let bytes: Vec<u8> =
                    items.iter().filter_map(Value::as_u64).filter_map(|b| u8::try_from(b).ok()).collect();
                Some(String::from_utf8_lossy(&bytes).into_owned())
            }
            Value::Array(items) => Some(items.iter().filter_map(text).collect::<Vec<_>>().join("\n")),
            _ => None,
        }
    }
    entry.get(name).and_then(text)
}

/// True when `entry` is one of corrald's own entries with `CORRAL_EVENT=event`.
pub fn is_corrald_event(entry: &Value, event: &str) -> bool {
    field(entry, "SYSLOG_IDENTIFIER").as_deref() == Some("corrald")
        && field(entry, "CORRAL_EVENT").as_deref() == Some(event)
}

/// corrald's lifecycle events in journal order: `(CORRAL_EVENT, MESSAGE)`.
pub fn corrald_events(entries: &[Value]) -> Vec<(String, String)> {
    entries
        .iter()
        .filter(|e| field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("corrald"))
        .filter_map(|e| Some((field(e, "CORRAL_EVENT")?, field(e, "MESSAGE").unwrap_or_default())))
        .collect()
}

/// A short, readable list of entries for failure messages.
pub fn summary(entries: &[Value]) -> String {
    let lines: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "[{} {}] {}",
                field(e, "SYSLOG_IDENTIFIER").unwrap_or_default(),
                field(e, "CORRAL_EVENT").unwrap_or_default(),
                field(e, "MESSAGE").unwrap_or_default()
            )
        })
        .collect();
    lines.join(" | ")
}
