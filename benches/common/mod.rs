//! What the benchmarks share: llama.cpp's binaries, processes killed on drop, corrald
//! started with a notify socket (so exec → `READY=1` is timed as systemd sees it), the
//! llama-server corrald runs started again directly with the same arguments, figures
//! from `/proc`, a private session bus, and a small HTTP/1.1 client.
//!
//! Each benchmark is its own crate and uses part of this module.
#![allow(dead_code, reason = "each benchmark uses part of the shared helpers")]

use std::io::Read;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// llama.cpp's `bin/` (llama-server, rpc-server, llama-fit-params), built by the setup
/// script when missing.
pub fn llama_bin_dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-llama-server.sh");
    let out = Command::new("bash").arg(&script).stderr(Stdio::inherit()).output().expect("run setup script");
    assert!(out.status.success(), "setup-llama-server.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// `llama-fit-params`: beside llama-server, else in the build directory next to it.
pub fn llama_fit_params(bin: &Path) -> PathBuf {
    let beside = bin.join("llama-fit-params");
    if beside.is_file() {
        return beside;
    }
    let key = bin.parent().and_then(Path::file_name).expect("the cache's key directory").to_string_lossy();
    let built =
        bin.parent().and_then(Path::parent).expect("the cache").join(format!("build-{key}/bin/llama-fit-params"));
    assert!(built.is_file(), "no llama-fit-params beside {} nor at {}", beside.display(), built.display());
    built
}

/// The corrald the benchmark measures: cargo's build of it (bench profile: release
/// settings), or `CORRAL_BENCH_CORRALD` to compare another build.
pub fn corrald_binary() -> PathBuf {
    std::env::var_os("CORRAL_BENCH_CORRALD").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_corrald")), PathBuf::from)
}

/// A number from the environment, else `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `path` as a quoted TOML string.
pub fn toml_string(path: &Path) -> String {
    toml::Value::String(path.to_str().expect("a UTF-8 temporary path").to_owned()).to_string()
}

/// A loopback TCP port free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Pins every thread of `pid` to `cpus` (a `taskset` list such as "0" or "1").
pub fn pin(pid: u32, cpus: &str) {
    let status = Command::new("taskset")
        .args(["-a", "-c", "-p", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("run taskset");
    assert!(status.success(), "taskset -p {cpus} {pid} failed");
}

/// Raises this process's soft limit on open files to `want` (at most the hard limit, which
/// root may raise too); returns the soft limit now.
pub fn raise_nofile(want: u64) -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let hard = if hard < want && setrlimit(Resource::RLIMIT_NOFILE, want, want).is_ok() { want } else { hard };
    let soft = want.min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("setrlimit");
    soft
}

/// A child process killed and reaped on drop.
pub struct Process(pub Child);

impl Process {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM, then waits at most `within` (SIGKILL after).
    pub fn stop(mut self, within: Duration) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + within;
        while self.0.try_wait().expect("wait").is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A private session bus (`dbus-daemon --session`) listening in `dir`: the process, killed
/// on drop, and its address.
pub fn session_bus(dir: &Path) -> (Process, String) {
    use std::io::BufRead;
    let mut child = Command::new("dbus-daemon")
        .args(["--session", "--nofork", "--print-address=1"])
        .arg(format!("--address=unix:path={}", dir.join("bus.sock").display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start dbus-daemon");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("bus address");
    (Process(child), line.trim().to_owned())
}

/// A process's memory and threads from `/proc/PID/status`.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    /// `VmRSS`, KiB.
    pub rss: u64,
    /// `VmHWM`, KiB.
    pub hwm: u64,
    /// `RssAnon`, KiB.
    pub anon: u64,
    /// `Threads`.
    pub threads: u64,
}

impl Memory {
    /// `VmRSS` in MiB.
    pub fn rss_mib(&self) -> f64 {
        kib_to_mib(self.rss)
    }
}

/// KiB as MiB.
pub fn kib_to_mib(kib: u64) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "KiB counts are small")]
    let mib = kib as f64 / 1024.0;
    mib
}

/// The memory of `pid`.
pub fn memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    Memory { rss: field("VmRSS:"), hwm: field("VmHWM:"), anon: field("RssAnon:"), threads: field("Threads:") }
}

/// The CPU time (user and system) `pid` has used so far, in ms. `/proc` counts it in
/// `USER_HZ` ticks, 100 a second on Linux's common architectures: 10 ms resolution, so
/// divide the difference over many calls.
pub fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    // Fields after the command (which may hold spaces), from the state on: utime is the 12th.
    let fields: Vec<&str> = stat.rsplit_once(')').expect("a stat line").1.split_whitespace().collect();
    let ticks = |i: usize| fields[i].parse::<u64>().expect("ticks");
    #[allow(clippy::cast_precision_loss, reason = "ticks are small")]
    let ms = (ticks(11) + ticks(12)) as f64 * 10.0;
    ms
}

/// The number of open file descriptors of `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// corrald started on `config` with a notify socket of the benchmark's own, as systemd
/// would start it; its stderr goes to the benchmark's.
pub struct Corrald {
    /// The process.
    pub process: Process,
    /// From just before `exec` to the `READY=1` datagram.
    pub ready_after: Duration,
}

impl Corrald {
    /// Starts corrald with `config` (a file in `dir`, whose `state` and `run` become its
    /// state and runtime directories) and `env`, and waits for `READY=1` (at most 60 s).
    pub fn start(dir: &Path, config: &Path, env: &[(&str, &str)]) -> Self {
        let notify_path = dir.join(format!("notify-{}.sock", fastrand::u64(..)));
        let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
        notify.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let mut command = Command::new(corrald_binary());
        command.arg("--config").arg(config).args(["--log-target", "stderr"]);
        command.env("STATE_DIRECTORY", dir.join("state")).env("RUNTIME_DIRECTORY", dir.join("run"));
        // CORRAL_BENCH_LOG: corrald's log filter, to see where its time goes.
        let log = std::env::var("CORRAL_BENCH_LOG").unwrap_or_else(|_| "error".to_owned());
        command.env("NOTIFY_SOCKET", &notify_path).env("RUST_LOG", log);
        for (key, value) in env {
            command.env(key, value);
        }
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        let start = Instant::now();
        let process = Process(command.spawn().expect("start corrald"));
        let mut buf = [0u8; 4096];
        let ready_after = loop {
            let n = notify.recv(&mut buf).expect("corrald sent no READY=1 within 60 s");
            if buf[..n].split(|b| *b == b'\n').any(|l| l == b"READY=1") {
                break start.elapsed();
            }
        };
        let _ = std::fs::remove_file(&notify_path);
        Self { process, ready_after }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// corrald's one llama-server child (any of its threads may have spawned it): its pid,
    /// argv and environment.
    pub fn child_argv(&self) -> (u32, ChildCommand) {
        let pid = self.pid();
        let mut children = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("read tasks") {
            let listed = std::fs::read_to_string(task.expect("task").path().join("children")).unwrap_or_default();
            children.extend(listed.split_whitespace().map(|p| p.parse::<u32>().expect("pid")));
        }
        assert_eq!(children.len(), 1, "corrald runs one child: {children:?}");
        let read = |what: &str| -> Vec<String> {
            std::fs::read(format!("/proc/{}/{what}", children[0]))
                .unwrap_or_else(|e| panic!("read /proc/PID/{what}: {e}"))
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        };
        (children[0], ChildCommand { argv: read("cmdline"), env: read("environ") })
    }

    /// SIGTERM, and a bounded wait for the exit.
    pub fn stop(self) {
        self.process.stop(Duration::from_secs(10));
    }
}

/// A store in `dir/models` holding the tiny llama as `name` (`PARAMETER num_thread 1`, so
/// a runner keeps to one CPU), written through the store's own create.
pub fn tiny_store(dir: &Path, name: &str) {
    use corral::store::Store;
    use corral::store::create::CreateSpec;
    use corral::store::modelfile::Modelfile;
    use corral::store::name::ModelName;
    let store = Store::open(&dir.join("models")).expect("store");
    corral::demo_model::write_tiny_llama(&dir.join("tiny.gguf")).expect("model");
    let modelfile = Modelfile::parse("FROM ./tiny.gguf\nPARAMETER num_thread 1\n").expect("modelfile");
    let spec = CreateSpec::from_modelfile(&modelfile, dir).expect("spec");
    store.create(&ModelName::parse(name).expect("name"), &spec, &mut |_| {}).expect("create");
}

/// A `/v1/chat/completions` body for `model`: `tokens` tokens exactly (`ignore_eos`), fixed
/// sampling and seed, the usage in the stream.
pub fn chat_body(model: &str, tokens: u64, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a story about a corral."}],
            "stream": stream,
            "stream_options": {"include_usage": true},
            "max_tokens": tokens,
            "ignore_eos": true,
            "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "seed": 7,
        })
        .to_string(),
    )
}

/// A llama-server command line as corrald ran it.
#[derive(Debug, Clone)]
pub struct ChildCommand {
    /// The argv, the program first.
    pub argv: Vec<String>,
    /// The environment, `NAME=value` each.
    pub env: Vec<String>,
}

/// Writes `corral.toml` in `dir`: listening on `port`, the store at `dir/models`, the given
/// llama-server, and `extra` (more tables).
pub fn write_config(dir: &Path, port: u16, llama_server: &Path, extra: &str) -> PathBuf {
    let config = dir.join("corral.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"127.0.0.1:{port}\"]\n[store]\npath = {}\n[runner]\nllama_server = {}\n{extra}",
            toml_string(&dir.join("models")),
            toml_string(llama_server),
        ),
    )
    .expect("config");
    config
}

/// `child` (a llama-server command line read from `/proc`) started again with the same
/// environment, listening on the loopback `port` instead of its UNIX socket, its stderr
/// drained; with the model alias.
pub fn start_direct(child: &ChildCommand, port: u16) -> (Process, String) {
    let argv = &child.argv;
    let alias = argv.iter().position(|a| a == "-a").map(|i| argv[i + 1].clone()).expect("-a ALIAS in the argv");
    let mut direct_args = argv[1..].to_vec();
    let host = direct_args.iter().position(|a| a == "--host").expect("--host in the argv");
    direct_args[host + 1] = "127.0.0.1".into();
    direct_args.extend(["--port".into(), port.to_string()]);
    let mut command = Command::new(&argv[0]);
    command.args(&direct_args).env_clear();
    for pair in &child.env {
        if let Some((key, value)) = pair.split_once('=') {
            command.env(key, value);
        }
    }
    let mut process = Process(
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start llama-server"),
    );
    let mut stderr = process.0.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while matches!(stderr.read(&mut sink), Ok(n) if n > 0) {}
    });
    (process, alias)
}

/// llama-server started again beside `daemon`'s one child with the child's argv, on a
/// loopback port, and waited for (`/health`); with `pinned` (a CPU list), corrald goes to
/// CPU 0 and both llama-servers to those CPUs. The process, its port, the model alias and
/// the argv.
pub async fn direct_beside(daemon: &Corrald, pinned: Option<&str>) -> (Process, u16, String, Vec<String>) {
    let (child_pid, child) = daemon.child_argv();
    let port = free_port();
    let (mut direct, alias) = start_direct(&child, port);
    wait_ready(port, "/health", &mut direct).await;
    if let Some(cpus) = pinned {
        pin(daemon.pid(), "0");
        pin(child_pid, cpus);
        pin(direct.pid(), cpus);
    }
    (direct, port, alias, child.argv)
}

/// The first position of `needle` in `hay` at or after `from`.
pub fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// Whether `data` holds a non-empty `"content":"…"` (an SSE delta or an Ollama message).
pub fn has_content(data: &[u8]) -> bool {
    const MARK: &[u8] = b"\"content\":\"";
    let mut from = 0;
    while let Some(at) = find(data, MARK, from) {
        let next = at + MARK.len();
        if data.get(next).is_some_and(|b| *b != b'"') {
            return true;
        }
        from = next;
    }
    false
}

/// The number after the last `"key":` in `data`.
pub fn last_number(data: &[u8], key: &str) -> Option<u64> {
    let mark = format!("\"{key}\":");
    let mut at = None;
    let mut from = 0;
    while let Some(found) = find(data, mark.as_bytes(), from) {
        at = Some(found + mark.len());
        from = found + 1;
    }
    let digits: String = data[at?..].iter().map(|b| char::from(*b)).take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// One kept-alive HTTP/1.1 connection, opened again when the server closed it
/// (llama-server closes a connection after a streamed answer, and after 100 requests).
pub struct Client {
    sender: SendRequest<Full<Bytes>>,
    port: u16,
    host: String,
}

impl Client {
    /// A new connection to the loopback `port`.
    pub async fn connect(port: u16) -> Self {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(connection);
        Self { sender, port, host: format!("127.0.0.1:{port}") }
    }

    /// Opens a new connection if the server closed this one.
    async fn reopen_if_closed(&mut self) {
        if self.sender.is_closed() || self.sender.ready().await.is_err() {
            *self = Self::connect(self.port).await;
        }
    }

    /// POSTs JSON `body` to `path`; panics unless the answer is a success.
    pub async fn post(&mut self, path: &str, body: &Bytes) -> hyper::Response<hyper::body::Incoming> {
        self.reopen_if_closed().await;
        let host = self.host.clone();
        let request = || {
            hyper::Request::post(path)
                .header("host", &host)
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .expect("request")
        };
        let response = match self.sender.send_request(request()).await {
            Ok(response) => response,
            // The server closed the connection as the request went out (a keep-alive limit):
            // nothing was processed, so send it again on a new one.
            Err(e) if e.is_canceled() || e.is_incomplete_message() => {
                *self = Self::connect(self.port).await;
                self.sender.send_request(request()).await.unwrap_or_else(|e| panic!("{} {path}: {e}", self.host))
            }
            Err(e) => panic!("{} {path}: {e}", self.host),
        };
        assert!(response.status().is_success(), "{path}: {}", response.status());
        response
    }

    /// GETs `path`; whether the answer was a success (its body read).
    pub async fn get(&mut self, path: &str) -> bool {
        self.get_body(path).await.is_some()
    }

    /// GETs `path`; the body of a successful answer.
    pub async fn get_body(&mut self, path: &str) -> Option<Bytes> {
        if self.sender.ready().await.is_err() {
            return None;
        }
        let request =
            hyper::Request::get(path).header("host", &self.host).body(Full::new(Bytes::new())).expect("request");
        match self.sender.send_request(request).await {
            Ok(response) => {
                let ok = response.status().is_success();
                let body = response.into_body().collect().await.ok()?.to_bytes();
                ok.then_some(body)
            }
            Err(_) => None,
        }
    }

    /// Streams `body` to `path` on a new connection (opened before the clock starts);
    /// returns the time to the first content frame, the time from it to the end, and the
    /// token count `count_key` reports.
    pub async fn stream(&mut self, path: &str, body: &Bytes, count_key: &str) -> (Duration, Duration, u64) {
        stream_once(self.port, path, body, count_key).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// A tiny `/v1/completions` request, its answer checked.
    pub async fn tiny(&mut self, body: &Bytes) {
        let response = self.post("/v1/completions", body).await;
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        assert!(find(&bytes, b"\"choices\"", 0).is_some(), "{}", String::from_utf8_lossy(&bytes));
    }
}

/// Streams `body` to `path` on a new connection to `port` (llama-server closes a connection
/// after a stream, so every stream starts on a new one, opened before the clock starts);
/// the time to the first content frame, the time from it to the end, and the token count
/// `count_key` reports; or what went wrong.
pub async fn stream_once(
    port: u16,
    path: &str,
    body: &Bytes,
    count_key: &str,
) -> Result<(Duration, Duration, u64), String> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| format!("connect: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(connection);
    let request = hyper::Request::post(path)
        .header("host", format!("127.0.0.1:{port}"))
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let response = sender.send_request(request).await.map_err(|e| format!("{path}: {e}"))?;
    let status = response.status();
    let mut response = response.into_body();
    let mut first = None;
    let mut all = Vec::with_capacity(16 << 10);
    while let Some(frame) = response.frame().await {
        let frame = frame.map_err(|e| format!("{path}: body: {e}"))?;
        if let Ok(data) = frame.into_data() {
            if first.is_none() && has_content(&data) {
                first = Some(start.elapsed());
            }
            all.extend_from_slice(&data);
        }
    }
    let total = start.elapsed();
    let text = || String::from_utf8_lossy(&all).into_owned();
    if !status.is_success() {
        return Err(format!("{path}: {status}: {}", text()));
    }
    let first = first.ok_or_else(|| format!("{path}: no content in {}", text()))?;
    let count = last_number(&all, count_key).ok_or_else(|| format!("{path}: no {count_key} in {}", text()))?;
    Ok((first, total.saturating_sub(first), count))
}

/// Waits until GET `path` on `port` succeeds (at most 30 s), while `process` runs.
pub async fn wait_ready(port: u16, path: &str, process: &mut Process) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(process.0.try_wait().expect("wait").is_none(), "the server on port {port} exited");
        if let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            if let Ok((sender, connection)) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                tokio::spawn(connection);
                let mut client = Client { sender, port, host: format!("127.0.0.1:{port}") };
                if client.get(path).await {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "the server on port {port} did not become ready");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The median of `samples` (not empty): the upper middle one, as the benchmarks' earlier
/// figures were taken.
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The `p`th percentile of `samples` (nearest rank; not empty).
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a rank among a few thousand samples"
    )]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
