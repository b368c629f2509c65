//! Real systemd as PID 1 of a throwaway container (`tests/rig/systemd-container.sh`).
//!
//! [`Container::boot`] gives each test its own container: a unique name, its own network
//! namespace (so 127.0.0.1:11434 is free in each), and a state directory under the cargo
//! target directory.  Dropping it powers the container off and removes its cgroups, also
//! when the test panics; the script's reaper does the same if the test process is killed.
//!
//! This module also holds the process helpers the other real-systemd fixtures share:
//! [`output_within`] (run a command with a deadline) and [`poll_until`] (wait for a
//! condition with a deadline, never a fixed sleep).

use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long booting may take before the test fails.  The machine is shared, so this is generous.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one command inside the container may take by default.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(90);
/// How long powering off may take before the script kills PID 1.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The repository root.
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Cargo's target directory (the one holding the `corrald` under test).
pub fn target_dir() -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_corrald"));
    exe.parent().and_then(Path::parent).map_or_else(|| repo_root().join("target"), Path::to_path_buf)
}

/// A script in `tests/rig/`.
pub fn rig_script(name: &str) -> PathBuf {
    repo_root().join("tests/rig").join(name)
}

/// Runs `cmd` with stdin closed, captures stdout and stderr, and kills it after `timeout`.
///
/// Panics, naming the command, when it cannot be started (a missing tool is a test failure,
/// never a skip) or when it runs past `timeout`.
pub fn output_within(cmd: &mut Command, timeout: Duration) -> Output {
    try_output_within(cmd, timeout).unwrap_or_else(|e| panic!("{e}"))
}

/// [`output_within`] that returns what went wrong instead of panicking (for `Drop`).
pub fn try_output_within(cmd: &mut Command, timeout: Duration) -> Result<Output, String> {
    let shown = show(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run `{shown}`: {e} (is the tool installed? see tests/rig/README.md)"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                let out = collect(&stdout, Duration::from_secs(2));
                let err = collect(&stderr, Duration::from_secs(2));
                return Err(format!(
                    "`{shown}` did not finish within {timeout:?}\n--- stdout:\n{}\n--- stderr:\n{}",
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&err)
                ));
            }
            Err(e) => return Err(format!("cannot wait for `{shown}`: {e}")),
        }
    };
    // Normally the pipes close with the process; a leftover grandchild holding them must not
    // hang the test, so the rest of the output is only awaited for a while.
    let rest = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(5));
    Ok(Output { status, stdout: collect(&stdout, rest), stderr: collect(&stderr, rest) })
}

/// Like [`output_within`], and panics with the command's output unless it exited with 0.
pub fn success_within(cmd: &mut Command, timeout: Duration) -> Output {
    let shown = show(cmd);
    let out = output_within(cmd, timeout);
    assert!(out.status.success(), "`{shown}` failed: {}", describe(&out));
    out
}

/// Polls `probe` every 100 ms until it returns `Ok`, and panics after `timeout` with `what`
/// and the last `Err` it returned (the last thing seen, to make a failure readable).
pub fn poll_until<T>(timeout: Duration, what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match probe() {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last seen: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// [`poll_until`] for a probe that awaits (D-Bus calls in an async test).
pub async fn poll_until_async<T, F>(timeout: Duration, what: &str, mut probe: impl FnMut() -> F) -> T
where
    F: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last seen: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A command line for messages.
pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Exit status, stdout and stderr of `out`, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "{}\n--- stdout:\n{}\n--- stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim_end(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    )
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        let _ = tx.send(buf);
    });
    rx
}

fn collect(rx: &mpsc::Receiver<Vec<u8>>, wait: Duration) -> Vec<u8> {
    rx.recv_timeout(wait).unwrap_or_else(|_| b"(output not closed in time)".to_vec())
}

/// A booted systemd container; powered off and cleaned up on drop.
pub struct Container {
    name: String,
    /// Parent of the state dir (`CT_DIR` of the script).
    ct_dir: PathBuf,
    /// The state dir, `ct_dir/name`.
    dir: PathBuf,
    /// Shown read-only at `/srv/host` inside.
    share: PathBuf,
    booted: Duration,
}

impl Container {
    /// Boots a new container for the test called `label` and waits until systemd reports the
    /// system running (or degraded, which is printed as a warning).  Panics when it does not boot.
    pub fn boot(label: &str) -> Self {
        Self::boot_in(label, "unified")
    }

    /// Boots a container whose systemd can limit memory (`MemoryMax=`): with cgroup2 inside
    /// where this host's cgroup2 has the memory controller, else with cgroup v1 hierarchies
    /// (a hybrid host, whose memory controller is a v1 hierarchy).
    pub fn boot_with_memory_controller(label: &str) -> Self {
        let unified = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            "/sys/fs/cgroup/cgroup.controllers"
        } else {
            "/sys/fs/cgroup/unified/cgroup.controllers"
        };
        let controllers = std::fs::read_to_string(unified).unwrap_or_default();
        Self::boot_in(label, if controllers.split_whitespace().any(|c| c == "memory") { "unified" } else { "legacy" })
    }

    /// Boots a container with cgroups in `mode` (`unified` or `legacy`, the script's `CGMODE`).
    fn boot_in(label: &str, mode: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let label: String = label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
            .take(24)
            .collect();
        let name = format!("corral-{label}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let ct_dir = target_dir().join("it-containers");
        let dir = ct_dir.join(&name);
        let share = dir.join("share");
        std::fs::create_dir_all(&share).expect("create the container's share dir");
        // From here on, Drop tears down whatever `up` managed to start.
        let mut ct = Self { name, ct_dir, dir, share, booted: Duration::ZERO };
        let started = Instant::now();
        let out = output_within(
            ct.script()
                .arg("up")
                .env("SHARE", &ct.share)
                .env("CGMODE", mode)
                .env("BOOT_TIMEOUT", BOOT_TIMEOUT.as_secs().to_string())
                .env("WATCH_PID", std::process::id().to_string()),
            BOOT_TIMEOUT + Duration::from_secs(30),
        );
        assert!(out.status.success(), "container {} did not boot: {}", ct.name, describe(&out));
        ct.booted = started.elapsed();
        let state = String::from_utf8_lossy(&out.stdout);
        eprintln!("container {} up in {:?}: {}", ct.name, ct.booted, state.trim());
        if state.contains("state=degraded") {
            let failed = ct.exec(&["systemctl", "--failed", "--no-pager", "--no-legend"]);
            eprintln!("warning: container {} is degraded:\n{}", ct.name, String::from_utf8_lossy(&failed.stdout));
        }
        ct
    }

    /// The container's name (also its hostname).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long `up` took.
    pub fn boot_time(&self) -> Duration {
        self.booted
    }

    /// The host directory shown read-only at `/srv/host` inside.
    pub fn share_dir(&self) -> &Path {
        &self.share
    }

    /// Runs `args` inside the container (all its namespaces, a clean environment) with the
    /// default timeout, and returns what it did; the caller checks the status.
    pub fn exec(&self, args: &[&str]) -> Output {
        self.exec_within(args, EXEC_TIMEOUT)
    }

    /// [`Container::exec`] with an explicit timeout.
    pub fn exec_within(&self, args: &[&str], timeout: Duration) -> Output {
        output_within(self.script().arg("exec").args(args), timeout)
    }

    /// Runs `args` inside, panics unless it succeeds, and returns its trimmed stdout.
    pub fn run(&self, args: &[&str]) -> String {
        let out = self.exec(args);
        assert!(out.status.success(), "in {}: `{}` failed: {}", self.name, args.join(" "), describe(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `systemctl show -P PROPERTY UNIT`: one property's value.
    pub fn unit_property(&self, unit: &str, property: &str) -> String {
        self.run(&["systemctl", "show", "-P", property, unit])
    }

    /// The overall exposure `systemd-analyze security UNIT` gives `unit` on this systemd.
    pub fn exposure(&self, unit: &str) -> f64 {
        let out = self.exec(&["systemd-analyze", "security", "--no-pager", unit]);
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.split(&format!("Overall exposure level for {unit}:")).nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no exposure score for {unit}: {}", describe(&out)))
    }

    /// The journal entries of `unit` (`journalctl -u UNIT -o json -a`), parsed.
    pub fn journal(&self, unit: &str) -> Vec<serde_json::Value> {
        let out = self.run(&["journalctl", "--no-pager", "-a", "-o", "json", "-u", unit]);
        out.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).expect("journal JSON")).collect()
    }

    /// Installs the corrald under test the way a package would: the binary at
    /// `/usr/bin/corrald`, the units from `systemd/` in `/etc/systemd/system`, the sysusers file
    /// at `/usr/lib/sysusers.d/corral.conf`; then runs `systemd-sysusers` and `daemon-reload`.
    pub fn install_corral(&self) {
        let staged = self.share.join("corral");
        let units = staged.join("units");
        std::fs::create_dir_all(&units).expect("create the staging dir");
        let binary = staged.join("corrald");
        let _ = std::fs::remove_file(&binary);
        // A hard link is instant and the binary is big; copy across file systems.
        if std::fs::hard_link(env!("CARGO_BIN_EXE_corrald"), &binary).is_err() {
            std::fs::copy(env!("CARGO_BIN_EXE_corrald"), &binary).expect("stage corrald");
        }
        let mut names = Vec::new();
        let systemd_dir = repo_root().join("systemd");
        for entry in std::fs::read_dir(&systemd_dir).expect("read systemd/") {
            let path = entry.expect("dir entry").path();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
            if ["service", "socket", "slice", "target", "timer", "path"].contains(&ext) {
                let file = path.file_name().expect("file name").to_string_lossy().into_owned();
                std::fs::copy(&path, units.join(&file)).expect("stage a unit");
                names.push(file);
            }
        }
        std::fs::copy(systemd_dir.join("corral.sysusers"), staged.join("corral.sysusers")).expect("stage sysusers");
        assert!(names.iter().any(|n| n == "corrald.service"), "systemd/ has no corrald.service: {names:?}");

        self.run(&["install", "-m", "0755", "/srv/host/corral/corrald", "/usr/bin/corrald"]);
        for unit in &names {
            let from = format!("/srv/host/corral/units/{unit}");
            let to = format!("/etc/systemd/system/{unit}");
            self.run(&["install", "-m", "0644", &from, &to]);
        }
        self.run(&[
            "install",
            "-D",
            "-m",
            "0644",
            "/srv/host/corral/corral.sysusers",
            "/usr/lib/sysusers.d/corral.conf",
        ]);
        self.run(&["systemd-sysusers", "/usr/lib/sysusers.d/corral.conf"]);
        self.run(&["getent", "passwd", "corral"]);
        self.run(&["getent", "group", "corral"]);
        self.run(&["systemctl", "daemon-reload"]);
        // A template (corral-rpc@.service) loads only as an instance: `worker_unit` starts those.
        for unit in names.iter().filter(|n| !n.contains("@.")) {
            let load = self.unit_property(unit, "LoadState");
            assert_eq!(load, "loaded", "unit {unit} did not load in {}", self.name);
        }
    }

    fn script(&self) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(rig_script("systemd-container.sh"))
            .env("NAME", &self.name)
            .env("CT_DIR", &self.ct_dir)
            .env("STOP_TIMEOUT", STOP_TIMEOUT.as_secs().to_string());
        cmd
    }

    /// What a failed test needs to see: the console and the container's journal.
    fn diagnostics(&self) -> String {
        let mut s = String::new();
        if let Ok(console) = std::fs::read_to_string(self.dir.join("console.log")) {
            let tail: Vec<&str> = console.lines().rev().take(40).collect();
            let _ = writeln!(s, "--- console of {} (last 40 lines):", self.name);
            for line in tail.iter().rev() {
                let _ = writeln!(s, "{line}");
            }
        }
        let journal = try_output_within(
            self.script().args(["exec", "journalctl", "--no-pager", "-b", "-n", "150"]),
            Duration::from_secs(30),
        );
        if let Ok(out) = journal {
            let _ = writeln!(s, "--- journal of {} (last 150 entries):", self.name);
            s.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        s
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let failing = std::thread::panicking();
        if failing {
            eprintln!("{}", self.diagnostics());
        }
        let started = Instant::now();
        let problem = match try_output_within(self.script().arg("down"), STOP_TIMEOUT + Duration::from_secs(60)) {
            Ok(out) if out.status.success() => None,
            Ok(out) => Some(format!("`down` failed: {}", describe(&out))),
            Err(e) => Some(e),
        };
        eprintln!("container {} down in {:?}", self.name, started.elapsed());
        match problem {
            // Keep the logs of a failed test; otherwise leave nothing behind.
            None if !failing => {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
            None => eprintln!("container {} logs kept in {}", self.name, self.dir.display()),
            Some(p) if failing => eprintln!("container {}: {p}", self.name),
            Some(p) => panic!("container {} was not cleaned up: {p}", self.name),
        }
    }
}
