//! An upstream `rpc-server` process as the tests run one, on loopback (`llama::RpcServer`)
//! or inside a network namespace (`netns::NsRpcServer`): started with SIGPIPE ignored, its
//! output collected line by line, killed and reaped on drop, and its fate printed when the
//! test that ran it fails.
//!
//! Self-contained (std only), as `netns.rs` is, so that `benches/rpc_workers.rs` uses it too.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an `rpc-server` may take to accept its first connection.
pub const RPC_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running (or ended) `rpc-server`. Dropping it kills it with SIGKILL and reaps it.
pub struct RpcProcess {
    child: Child,
    /// Where it listens, for messages: `rpc-server on …`.
    place: String,
    /// Its stdout (`Accepted client connection`, …) and stderr, and a condition the
    /// threads reading them signal at each line and at each pipe's end.
    output: Arc<(Mutex<Output>, Condvar)>,
    status: Option<ExitStatus>,
}

/// What an `rpc-server` printed so far, one line per element, and how many of its two
/// pipes are still open (none once it has ended).
#[derive(Default)]
struct Output {
    lines: Vec<String>,
    open: usize,
}

impl RpcProcess {
    /// Runs `program` with `args` through `sh` (a command that runs it: `sh` itself, or
    /// `ip netns exec NS sh`, with any environment already set). The shell takes one `step`
    /// with its argument (`$0`: `:` for none, or a limit to put on itself), ignores SIGPIPE
    /// and becomes rpc-server (an ignored signal stays ignored across exec, and the PID is
    /// rpc-server's).
    ///
    /// SIGPIPE is ignored as systemd starts a service (`IgnoreSIGPIPE=yes`, the default, so
    /// under `corral-rpc@.service`): rpc-server writes with `send(…, 0)`, so a client whose
    /// connection was reset while it wrote (a runner killed mid-answer, a head cut off and
    /// back, another test's client of a port used before) would kill it; ignored, the
    /// write fails and it drops that client.
    pub fn spawn(mut sh: Command, step: &str, step_arg: &OsStr, program: &Path, args: &[&str], place: String) -> Self {
        sh.arg("-c").arg(format!(r#"{step} && trap '' PIPE && exec "$@""#)).arg(step_arg).arg(program).args(args);
        let mut child = sh
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {sh:?}: {e}"));
        let output = Arc::new((Mutex::new(Output { lines: Vec::new(), open: 2 }), Condvar::new()));
        for pipe in [
            child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
            child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>),
        ] {
            let (output, pipe) = (Arc::clone(&output), pipe.expect("piped"));
            std::thread::spawn(move || {
                let (lock, changed) = &*output;
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    lock.lock().expect("output lock").lines.push(line);
                    changed.notify_all();
                }
                lock.lock().expect("output lock").open -= 1;
                changed.notify_all();
            });
        }
        Self { child, place, output, status: None }
    }

    /// Waits until it accepts connections: until `connect` (a probe connection, closed
    /// again) succeeds and rpc-server printed that it accepted one, so that what answered
    /// is this process and not another on the same port. On failure, why, with its output.
    pub fn wait_accepting(&mut self, mut connect: impl FnMut() -> bool) -> Result<(), String> {
        let deadline = Instant::now() + RPC_READY_TIMEOUT;
        while !connect() {
            if let Some(status) = self.exit_status() {
                return Err(format!("{} exited ({status}):\n{}", self.place, self.output()));
            }
            if Instant::now() >= deadline {
                return Err(format!("{} not reachable within {RPC_READY_TIMEOUT:?}:\n{}", self.place, self.output()));
            }
            // Nothing tells when rpc-server listens (it prints only before it binds): the
            // probe itself is the condition, retried until the deadline.
            std::thread::sleep(Duration::from_millis(10));
        }
        // Its stdout is flushed at each connection.
        self.try_wait_lines("Accepted client connection", 1, deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| format!("another process answered for {}:\n{}", self.place, self.output()))
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn printed(&self) -> MutexGuard<'_, Output> {
        self.output.0.lock().expect("output lock")
    }

    /// What it printed so far, one line per element.
    pub fn output(&self) -> String {
        self.printed().lines.join("\n")
    }

    /// How many of its lines contain `text`.
    pub fn count_lines(&self, text: &str) -> usize {
        count(&self.printed(), text)
    }

    /// Waits until a line contains `text`.
    pub fn wait_output(&self, text: &str, timeout: Duration) {
        self.wait_lines(text, 1, timeout);
    }

    /// Waits until `n` lines contain `text`.
    pub fn wait_lines(&self, text: &str, n: usize, timeout: Duration) {
        self.try_wait_lines(text, n, timeout).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits until `n` lines contain `text`, while its output may still grow.
    fn try_wait_lines(&self, text: &str, n: usize, timeout: Duration) -> Result<(), String> {
        let (lock, changed) = &*self.output;
        let printed = lock.lock().expect("output lock");
        let (printed, _) =
            changed.wait_timeout_while(printed, timeout, |o| count(o, text) < n && o.open > 0).expect("output lock");
        if count(&printed, text) >= n {
            return Ok(());
        }
        let ended = if printed.open == 0 { " (it closed its output)" } else { "" };
        Err(format!("no {n}×{text:?} from {} within {timeout:?}{ended}:\n{}", self.place, printed.lines.join("\n")))
    }

    /// Its resident memory in bytes (`VmRSS`), while it runs.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("read its status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS");
        kib * 1024
    }

    /// How it ended, if it did (reaped then); `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("poll rpc-server");
        }
        self.status
    }

    /// Waits up to `timeout` for it to exit by itself and reaps it; `None` if it still runs.
    /// Its pipes close when it ends (rpc-server starts no process of its own).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let (lock, changed) = &*self.output;
        let printed = lock.lock().expect("output lock");
        let (printed, _) = changed.wait_timeout_while(printed, timeout, |o| o.open > 0).expect("output lock");
        let ended = printed.open == 0;
        drop(printed);
        if ended && self.status.is_none() {
            self.status = Some(self.child.wait().expect("reap rpc-server"));
        }
        self.exit_status()
    }

    /// Sends SIGKILL and reaps it; its exit status.  Idempotent.
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.exit_status() {
            return status;
        }
        // ESRCH: it ended in between; the wait reaps it all the same.
        let _ = self.child.kill();
        *self.status.insert(self.child.wait().expect("reap rpc-server"))
    }
}

impl Drop for RpcProcess {
    fn drop(&mut self) {
        // A failing test shows how its worker fared: whether it ended by itself, and what
        // it printed (a worker that ended early explains a load that failed).
        let fate = std::thread::panicking().then(|| match (self.status, self.child.try_wait()) {
            (Some(status), _) => format!("already reaped by the test ({status})"),
            (None, Ok(Some(status))) => format!("had ended by itself ({status})"),
            (None, Ok(None)) => "still running".to_owned(),
            (None, Err(e)) => format!("unknown ({e})"),
        });
        self.kill();
        if let Some(fate) = fate {
            eprintln!("{} at the failure: {fate}\n{}", self.place, self.output());
        }
    }
}

/// How many of `printed`'s lines contain `text`.
fn count(printed: &Output, text: &str) -> usize {
    printed.lines.iter().filter(|l| l.contains(text)).count()
}
