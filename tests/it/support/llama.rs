//! The real upstream `llama-server`, built once by `scripts/setup-llama-server.sh` and
//! started on a model with HTTP on a UNIX socket in a temporary directory.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::http;
use super::rpc_process::RpcProcess;

/// How long a start may take up to the `listening on` line.  The tiny models load in
/// milliseconds, but the machine is shared with other builds.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a stop waits after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The directory holding `llama-server`, `rpc-server` and `llama-fit-params`.  The first
/// call in a test process runs `scripts/setup-llama-server.sh`, which builds them once into
/// a cache (minutes) and afterwards only prints the directory; a failure panics, since these
/// tests never skip.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = super::setup::run("setup-llama-server.sh");
        assert!(dir.join("llama-server").is_file(), "{} holds no llama-server", dir.display());
        dir
    })
    .clone()
}

/// llama.cpp's `llama-fit-params`: the per-device memory projection of a load, without
/// loading weights (`--fit-print on`).
pub fn fit_params() -> PathBuf {
    let path = bin_dir().join("llama-fit-params");
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

/// A running `llama-server` on a UNIX socket.  Dropping it stops it: SIGTERM, up to 10 s
/// for it to exit, then SIGKILL; the child is always reaped.
pub struct LlamaServer {
    child: Child,
    socket: PathBuf,
    stderr: Arc<Mutex<Vec<String>>>,
    reader: Option<JoinHandle<()>>,
    /// Holds the socket; removed after the server is stopped.
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    /// Starts `llama-server -m MODEL --host DIR/llama.sock -lv 4 ARGS…` and returns once it
    /// is ready: its stderr said `listening on` (within 60 s) and `GET /health` gave 200.
    /// Panics with the captured stderr if it exits or times out first.
    pub fn start(model: &Path, args: &[&str]) -> Self {
        let (mut server, lines) = Self::spawn(model, args);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("listening on") => break,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    panic!("llama-server not ready within {READY_TIMEOUT:?}; stderr:\n{}", server.stderr())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = server.child.wait().expect("wait for llama-server");
                    panic!("llama-server exited ({status}) before it was ready; stderr:\n{}", server.stderr());
                }
            }
        }
        let health = server.request("GET", "/health", None);
        assert_eq!(health.status, 200, "GET /health: {}; stderr:\n{}", health.body, server.stderr());
        server
    }

    /// Starts it as [`Self::start`] does, for a load that must fail: waits (at most 60 s) for
    /// it to exit, and returns how it ended, its whole stderr and the time it took.  Panics
    /// if it gets ready or does not end in time.
    pub fn start_to_fail(model: &Path, args: &[&str]) -> Failed {
        let started = Instant::now();
        let (mut server, lines) = Self::spawn(model, args);
        let deadline = started + READY_TIMEOUT;
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains("listening on") => {
                    panic!("llama-server loaded, but the load had to fail; stderr:\n{}", server.stderr())
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    panic!("llama-server did not end within {READY_TIMEOUT:?}; stderr:\n{}", server.stderr())
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let status = server
            .wait_exit(remaining)
            .unwrap_or_else(|| panic!("llama-server closed stderr but runs on; stderr:\n{}", server.stderr()));
        Failed { status, stderr: server.stderr_lines(), took: started.elapsed() }
    }

    /// Spawns the child and its stderr reader; the receiver gets each line.
    fn spawn(model: &Path, args: &[&str]) -> (Self, mpsc::Receiver<String>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("llama.sock");
        let mut child = Command::new(bin_dir().join("llama-server"))
            .arg("-m")
            .arg(model)
            .arg("--host")
            .arg(&socket)
            .args(["-lv", "4"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn llama-server");
        let pipe = child.stderr.take().expect("stderr is piped");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (lines_tx, lines) = mpsc::channel();
        let reader = {
            let stderr = Arc::clone(&stderr);
            std::thread::spawn(move || collect_lines(pipe, &stderr, &lines_tx))
        };
        (Self { child, socket, stderr, reader: Some(reader), _dir: dir }, lines)
    }

    /// Waits up to `timeout` for the child to exit by itself, reaps it and waits for the
    /// rest of its stderr; `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("poll llama-server") {
                break status;
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        Some(status)
    }

    /// The UNIX socket the server listens on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server wrote to stderr so far, one line per element.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().expect("stderr lock").clone()
    }

    /// Everything the server wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr_lines().join("\n")
    }

    /// Sends one HTTP/1.1 request (`Connection: close`, a JSON body if any) over the socket.
    pub fn request(&self, method: &str, path: &str, body: Option<&serde_json::Value>) -> http::Response {
        let body = body.map(serde_json::Value::to_string);
        http::unix(&self.socket, method, path, body.as_deref())
    }

    /// POSTs `body` as JSON to `path`, checks for 200, and returns the JSON answer.
    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let response = self.request("POST", path, Some(body));
        assert_eq!(response.status, 200, "POST {path}: {}; stderr:\n{}", response.body, self.stderr());
        response.json()
    }

    /// GETs `path`, checks for 200, and returns the JSON answer.
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let response = self.request("GET", path, None);
        assert_eq!(response.status, 200, "GET {path}: {}; stderr:\n{}", response.body, self.stderr());
        response.json()
    }

    /// Stops the server (SIGTERM, then SIGKILL after 10 s), reaps it, waits until all of its
    /// stderr is captured, and returns its exit status.  Idempotent.
    pub fn stop(&mut self) -> ExitStatus {
        let status = if let Some(status) = self.child.try_wait().expect("poll llama-server") {
            status
        } else {
            let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits i32"));
            // ESRCH: it exited in between; the wait below reaps it.
            let _ = kill(pid, Signal::SIGTERM);
            let deadline = Instant::now() + STOP_TIMEOUT;
            loop {
                if let Some(status) = self.child.try_wait().expect("poll llama-server") {
                    break status;
                }
                if Instant::now() >= deadline {
                    let _ = self.child.kill();
                    break self.child.wait().expect("reap llama-server");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        status
    }
}

/// How a load that had to fail ended ([`LlamaServer::start_to_fail`]).
#[derive(Debug)]
pub struct Failed {
    /// The exit status.
    pub status: ExitStatus,
    /// Everything it wrote to stderr, one line per element.
    pub stderr: Vec<String>,
    /// From spawn to exit.
    pub took: Duration,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Appends each stderr line to `into` and offers it on `tx` (ignored once nobody listens),
/// until the pipe closes.  Bytes that are not UTF-8 are replaced, never dropped.
fn collect_lines(pipe: impl Read, into: &Mutex<Vec<String>>, tx: &mpsc::Sender<String>) {
    let mut pipe = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match pipe.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_owned();
                into.lock().expect("stderr lock").push(line.clone());
                let _ = tx.send(line);
            }
        }
    }
}

/// A memory limit for an `rpc-server`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryLimit {
    /// A memory cgroup of its own: cgroup2's `memory.max` where the memory controller is on
    /// the cgroup2 hierarchy, else cgroup v1's `memory.limit_in_bytes` (hybrid hosts).  Pages
    /// past the limit get the process killed by the kernel's OOM killer: an allocation
    /// never fails, since only touched pages are charged.
    Cgroup(u64),
    /// `ulimit -v` (`RLIMIT_AS`) in KiB of address space: an allocation past it fails, which
    /// llama.cpp reports as an allocation failure of the device's buffer.
    AddressSpace(u64),
}

/// An `rpc-server` on loopback: llama.cpp's RPC backend makes it a device (`RPC0`, … in the
/// order of `--rpc`), so offload is real.  Dropping it kills it with SIGKILL, reaps it, and
/// removes its cgroup.  The process's own methods ([`RpcProcess`]) are reached through it.
pub struct RpcServer {
    process: RpcProcess,
    port: u16,
    /// Declared after the process, so dropped once its one process is reaped.
    cgroup: Option<MemoryCgroup>,
}

impl RpcServer {
    /// Starts `rpc-server` on `127.0.0.1:port` and waits until it accepts connections.
    pub fn start(port: u16) -> Self {
        Self::spawn(port, None).unwrap_or_else(|output| panic!("rpc-server on port {port} failed:\n{output}"))
    }

    /// Starts `rpc-server` on a free port of loopback; a port taken meanwhile by someone
    /// else is given up for another.
    pub fn start_free() -> Self {
        Self::start_free_limited(None)
    }

    /// Starts `rpc-server` on a free port under `limit`.
    pub fn start_limited(limit: MemoryLimit) -> Self {
        Self::start_free_limited(Some(limit))
    }

    fn start_free_limited(limit: Option<MemoryLimit>) -> Self {
        let mut failures = Vec::new();
        for _ in 0..5 {
            let port = super::corrald::free_port();
            match Self::spawn(port, limit) {
                Ok(server) => return server,
                Err(output) => failures.push(format!("port {port}:\n{output}")),
            }
        }
        panic!("rpc-server did not start on 5 free ports:\n{}", failures.join("\n"));
    }

    /// Spawns it under `limit` and waits until it accepted a probe connection; on failure,
    /// why, with its output.
    fn spawn(port: u16, limit: Option<MemoryLimit>) -> Result<Self, String> {
        let port_arg = port.to_string();
        let (step, step_arg, cgroup): (&str, OsString, _) = match limit {
            None => (":", "rpc-server".into(), None),
            Some(MemoryLimit::Cgroup(bytes)) => {
                // The shell moves itself into the cgroup.
                let cgroup = MemoryCgroup::create(bytes);
                (r#"echo $$ > "$0""#, cgroup.procs_file().into(), Some(cgroup))
            }
            Some(MemoryLimit::AddressSpace(kib)) => (r#"ulimit -v "$0""#, kib.to_string().into(), None),
        };
        let process = RpcProcess::spawn(
            Command::new("sh"),
            step,
            &step_arg,
            &bin_dir().join("rpc-server"),
            &["-H", "127.0.0.1", "-p", &port_arg],
            format!("rpc-server on port {port}"),
        );
        let mut server = Self { process, port, cgroup };
        server.process.wait_accepting(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())?;
        Ok(server)
    }

    /// `127.0.0.1:PORT`, as `--rpc` takes it.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// How many times the kernel's OOM killer acted in its cgroup, if it has one.
    pub fn oom_kills(&self) -> Option<u64> {
        self.cgroup.as_ref().map(MemoryCgroup::oom_kills)
    }

    /// The memory cgroup's directory, if it has one.
    pub fn cgroup(&self) -> Option<&Path> {
        self.cgroup.as_ref().map(|c| c.dir.as_path())
    }
}

impl Deref for RpcServer {
    type Target = RpcProcess;

    fn deref(&self) -> &RpcProcess {
        &self.process
    }
}

impl DerefMut for RpcServer {
    fn deref_mut(&mut self) -> &mut RpcProcess {
        &mut self.process
    }
}

/// A memory cgroup made for one process, removed on drop once it is empty.
struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// Creates `corral-it-rpc-<pid>-<n>` with a memory limit of `bytes`: under the cgroup2
    /// mount if its root offers the memory controller, else under cgroup v1's memory mount.
    fn create(bytes: u64) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
        let name =
            format!("corral-it-rpc-{}-{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let v2_root = corral::supervisor::cgroup::cgroup2_mount(&mountinfo).filter(|root| {
            std::fs::read_to_string(root.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        });
        let (parent, v2) = match v2_root {
            Some(root) => {
                // Children of the root get the controller only when the root passes it on.
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
                (root, true)
            }
            None => (
                cgroup1_memory_mount(&mountinfo).unwrap_or_else(|| {
                    panic!("neither cgroup2 nor cgroup v1 offers a memory controller:\n{mountinfo}")
                }),
                false,
            ),
        };
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let cgroup = Self { dir, v2 };
        let (limit, swap) = if v2 {
            ("memory.max", "memory.swap.max")
        } else {
            ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        };
        std::fs::write(cgroup.dir.join(limit), bytes.to_string())
            .unwrap_or_else(|e| panic!("write {limit} in {}: {e}", cgroup.dir.display()));
        // No swap to spill into (absent when the kernel accounts no swap).
        let _ = std::fs::write(cgroup.dir.join(swap), if v2 { "0".to_owned() } else { bytes.to_string() });
        cgroup
    }

    fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// `oom_kill` of `memory.events` (cgroup2) or `memory.oom_control` (v1).
    fn oom_kills(&self) -> u64 {
        let file = self.dir.join(if self.v2 { "memory.events" } else { "memory.oom_control" });
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no oom_kill in {}: {text}", file.display()))
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // Its process is reaped, but the kernel may take a moment to empty the cgroup.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(self.procs_file()).is_ok_and(|p| !p.trim().is_empty())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Where cgroup v1's memory hierarchy is mounted, from `/proc/self/mountinfo`.
fn cgroup1_memory_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (fields, fs) = line.split_once(" - ")?;
        let mut fs = fs.split_whitespace();
        let (fstype, _source, options) = (fs.next()?, fs.next()?, fs.next()?);
        if fstype != "cgroup" || !options.split(',').any(|o| o == "memory") {
            return None;
        }
        fields.split_whitespace().nth(4).map(PathBuf::from)
    })
}
