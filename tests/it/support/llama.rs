//! The real upstream `llama-server`, built once by `scripts/setup-llama-server.sh` and
//! started on a model with HTTP on a UNIX socket in a temporary directory.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::http;

/// How long a start may take up to the `listening on` line.  The tiny models load in
/// milliseconds, but the machine is shared with other builds.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a stop waits after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The directory holding `llama-server`, `rpc-server` and `llama-fit-params`.  The first call in a test process
/// runs `scripts/setup-llama-server.sh`, which builds them once into a cache (minutes) and
/// afterwards only prints the directory; a failure panics, since these tests never skip.
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
        let mut server = Self { child, socket, stderr, reader: Some(reader), _dir: dir };

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

/// An `rpc-server` on loopback: llama.cpp's RPC backend makes it a device, so offload is real.
pub struct RpcServer(Child);

impl RpcServer {
    /// Starts `rpc-server` on `127.0.0.1:port` and waits until it accepts connections.
    pub fn start(port: u16) -> Self {
        let child = Command::new(bin_dir().join("rpc-server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rpc-server");
        http::connect("rpc-server", || std::net::TcpStream::connect(("127.0.0.1", port)));
        Self(child)
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
