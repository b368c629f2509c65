//! Runs the real `corrald` binary as a child, directly or under `systemd-socket-activate`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The daemon binary under test.
pub const CORRALD: &str = env!("CARGO_BIN_EXE_corrald");

/// `RUST_LOG` that shows each idle check (see [`Corrald::idle_checks`]).
pub const IDLE_CHECKS: &str = "info,corral::daemon=debug";

/// A loopback port that was free a moment ago, for a daemon the test starts to bind.
///
/// It is drawn from below the kernel's ephemeral range: a port that `bind(0)` hands
/// out is one the kernel may give the next moment to any test's outgoing
/// connection, and a daemon that then finds it taken exits (`EADDRINUSE`): the likely
/// cause of a CI run in which a corrald exited at start. Below that range only
/// listeners that name their port compete.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let low: u16 = range.split_whitespace().next().and_then(|p| p.parse().ok()).unwrap_or(32768);
    let (first, count) = (low / 2, low - low / 2);
    // A random start, so that tests running at once begin at different ports.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    let start = hasher.finish() % u64::from(count);
    (0..u64::from(count))
        .map(|i| first + u16::try_from((start + i) % u64::from(count)).expect("under the range's size"))
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free loopback port below the ephemeral range")
}

/// Writes `text` as a config file in `dir` and returns its path.
pub fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

/// A running corrald; stopped (SIGTERM, then SIGKILL) and reaped on drop.
pub struct Corrald {
    child: Child,
    stderr: Arc<Mutex<String>>,
    /// Says when the reader reached the end of stderr.
    stderr_done: std::sync::mpsc::Receiver<()>,
    status: Option<ExitStatus>,
    /// The state and runtime directories it was given, so that no test writes to
    /// `/var/lib/corral` or `/run/corral`.
    dirs: tempfile::TempDir,
    /// The state directory: in `dirs`, or the one the command named.
    state: PathBuf,
}

impl Corrald {
    /// `corrald ARGS` with `NOTIFY_SOCKET` when given, logging to stderr.
    pub fn start(args: &[&str], notify: Option<&Path>) -> Self {
        let mut cmd = Command::new(CORRALD);
        cmd.args(["--log-target", "stderr"]).args(args);
        if let Some(notify) = notify {
            cmd.env("NOTIFY_SOCKET", notify);
        }
        Self::spawn(cmd)
    }

    /// `corrald ARGS` as [`Corrald::start`] runs it, inside the network namespace `netns`
    /// (`ip netns exec`, which execs corrald: the PID is corrald's).
    pub fn start_in_netns(netns: &str, args: &[&str], notify: &Path) -> Self {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns, CORRALD, "--log-target", "stderr"]).args(args);
        cmd.env("NOTIFY_SOCKET", notify);
        Self::spawn(cmd)
    }

    /// `corrald ARGS` under `systemd-socket-activate`, listening on each of `listen` with fd name `http`.
    /// The tool waits for the first connection, then runs corrald in its place (same PID).
    pub fn socket_activated(listen: &[String], args: &[&str], notify: &Path, extra_env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new("systemd-socket-activate");
        for addr in listen {
            cmd.args(["-l", addr]);
        }
        cmd.arg(format!("--fdname={}", vec!["http"; listen.len()].join(":")));
        // The tool passes on only the variables named with -E.
        cmd.env("NOTIFY_SOCKET", notify).args(["-E", "NOTIFY_SOCKET", "-E", "RUST_LOG"]);
        cmd.args(["-E", "STATE_DIRECTORY", "-E", "RUNTIME_DIRECTORY"]);
        for (k, v) in extra_env {
            cmd.env(k, v).args(["-E", k]);
        }
        cmd.arg(CORRALD).args(["--log-target", "stderr"]).args(args);
        Self::spawn(cmd)
    }

    /// Runs `cmd` (corrald, or a tool that execs it) with stderr captured, in state and
    /// runtime directories of its own unless `cmd` names a state directory (a restart).
    pub fn spawn(mut cmd: Command) -> Self {
        let dirs = tempfile::tempdir().expect("tempdir");
        let named = cmd.get_envs().find(|(k, _)| *k == "STATE_DIRECTORY").and_then(|(_, v)| v.map(PathBuf::from));
        let state = named.unwrap_or_else(|| dirs.path().join("state"));
        cmd.env("STATE_DIRECTORY", &state);
        cmd.env("RUNTIME_DIRECTORY", dirs.path().join("run"));
        if !cmd.get_envs().any(|(k, _)| k == "RUST_LOG") {
            cmd.env("RUST_LOG", "info");
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("stderr");
        let sink = Arc::clone(&stderr);
        let (done, stderr_done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().expect("lock").push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            let _ = done.send(());
        });
        Self { child, stderr, stderr_done, status: None, dirs, state }
    }

    /// The state directory it was given (`STATE_DIRECTORY`).
    pub fn state_dir(&self) -> PathBuf {
        self.state.clone()
    }

    /// The process id.
    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid"))
    }

    /// Sends a signal.
    pub fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).expect("kill");
    }

    /// Everything corrald wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("lock").clone()
    }

    /// Waits until stderr contains `text`.
    pub fn wait_stderr(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.stderr().contains(text) {
            assert!(Instant::now() < deadline, "no {text:?} on stderr within {timeout:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many idle checks corrald logged so far (at debug level: start it with
    /// [`IDLE_CHECKS`] as `RUST_LOG`).
    pub fn idle_checks(&self) -> usize {
        self.stderr().matches("corral_event=\"idle_check\"").count()
    }

    /// Waits until `n` more idle checks than `since` have run, so that a test can say
    /// "several checks passed" without sleeping for them.
    pub fn wait_idle_checks(&self, since: usize, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.idle_checks() < since + n {
            assert!(Instant::now() < deadline, "fewer than {n} idle checks within {timeout:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to exit and returns its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.status = Some(status);
                // The pipe's last lines are read once the reader sees its end (a child
                // that kept the pipe open would hold it: bounded).
                let _ = self.stderr_done.recv_timeout(Duration::from_secs(5));
                return status;
            }
            assert!(Instant::now() < deadline, "corrald still running after {timeout:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Corrald {
    fn drop(&mut self) {
        if self.status.is_some() || matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = kill(self.pid(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// corrald on the demo models' store in `dir` (`support::api::demo_store`), with the real
/// llama-server, a fixed CPU-only inventory of 4 GiB, `extra` appended to its
/// configuration and a free loopback port; started (not yet ready), with its port.
pub fn on_demo_store_with(dir: &Path, extra: &str, notify: &crate::support::notify::NotifyListener) -> (Corrald, u16) {
    crate::support::api::demo_store(dir);
    let port = free_port();
    let config = write_config(
        dir,
        "corral.toml",
        &format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = \"{}\"\n[runner]\nllama_server = \"{}\"\n\
             [scheduler]\nnum_ctx = 512\n[gpu]\nfixed = true\nhost_memory = \"4GiB\"\n{extra}",
            dir.join("models").display(),
            crate::support::llama::bin_dir().join("llama-server").display(),
        ),
    );
    (Corrald::start(&["--config", config.to_str().expect("utf-8")], Some(notify.path())), port)
}

/// [`on_demo_store_with`] and nothing more, returned ready, with the notify listener it
/// reported to.
pub fn on_demo_store(dir: &Path) -> (Corrald, u16, crate::support::notify::NotifyListener) {
    let notify = crate::support::notify::NotifyListener::start();
    let (corrald, port) = on_demo_store_with(dir, "", &notify);
    notify.wait_for("READY", "1", Duration::from_secs(60));
    (corrald, port, notify)
}
