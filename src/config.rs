//! The configuration: a strict TOML schema, built-in defaults, and layered loading.
//!
//! Sources, later ones winning key by key: the built-in defaults, the main file
//! (`/etc/corral/corral.toml` or `--config PATH`), then its drop-ins
//! (`<file>.d/*.toml`) in file-name order.  Every file is checked on its own
//! against the schema first, so an error names the file, the line, the key and
//! what was expected.  Tables merge recursively; any other value (arrays included)
//! is replaced as a whole.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// The whole configuration after all layers were merged and checked.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    /// `[server]`: the HTTP API.
    pub server: ServerConfig,
    /// `[store]`: the model store.
    pub store: StoreConfig,
    /// `[runner]`: how llama-server children are run.
    pub runner: RunnerConfig,
    /// `[scheduler]`: which models stay loaded, and for how long.
    pub scheduler: SchedulerConfig,
    /// `[gpu]`: the device inventory.
    pub gpu: GpuConfig,
    /// `[dbus]`: the control interface.
    pub dbus: DbusConfig,
    /// `[models."NAME"]`: per-model policy.
    pub models: BTreeMap<String, ModelPolicy>,
    /// `[[workers]]`: ggml `rpc-server` endpoints whose devices models may be placed on.
    pub workers: Vec<WorkerConfig>,
    /// `[worker_health]`: how the workers are checked.
    pub worker_health: WorkerHealthConfig,
}

/// `[worker_health]`: each worker is checked at start and then every `interval`; a check
/// that gets no connection within `timeout` marks it down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerHealthConfig {
    /// How often each worker is checked.
    #[serde(deserialize_with = "positive_duration")]
    pub interval: Duration,
    /// How long one check's connection may take, and how long a runner's connection to
    /// a worker may go unanswered.
    #[serde(deserialize_with = "positive_duration")]
    pub timeout: Duration,
}

impl Default for WorkerHealthConfig {
    fn default() -> Self {
        Self { interval: Duration::from_secs(10), timeout: Duration::from_secs(3) }
    }
}

/// `[dbus]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DbusConfig {
    /// Which bus serves `org.corral.Corral1`.
    pub bus: BusKind,
    /// Store jobs (`Pull`, `Push`, `Create`, `CreateWithFiles`, `Copy`, `Delete`) running at once; more are refused
    /// with `org.corral.Corral1.Error.Busy` until one finishes.
    #[serde(deserialize_with = "positive_count")]
    pub max_jobs: u32,
}

impl Default for DbusConfig {
    fn default() -> Self {
        Self { bus: BusKind::default(), max_jobs: 16 }
    }
}

/// A message bus to serve on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BusKind {
    /// The system bus (`$DBUS_SYSTEM_BUS_ADDRESS`, else its standard socket).
    #[default]
    System,
    /// The session bus of the user running corrald, for development and user units.
    Session,
    /// No D-Bus interface.
    Off,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Addresses to bind when systemd passes no socket: `"IP:PORT"` or an absolute UNIX socket path.
    pub listen: Vec<ListenAddr>,
    /// How long a graceful shutdown may take before open connections are dropped.
    #[serde(deserialize_with = "duration")]
    pub shutdown_timeout: Duration,
    /// Host header values allowed on connections to a loopback address besides the names
    /// of this machine (Ollama's rule, `http::safety`): hostnames or IPs,
    /// `"*.example.org"` for its subdomains, `"*"` for any host.
    #[serde(deserialize_with = "host_patterns")]
    pub allowed_hosts: Vec<String>,
    /// Origins whose browser pages may call the API (CORS): exact origins, patterns with
    /// one `*` (`"http://localhost:*"`), or `"*"` for any origin.
    #[serde(deserialize_with = "origin_patterns")]
    pub cors_origins: Vec<String>,
    /// Bearer tokens; when any is set, every request but `GET /` and `HEAD /` needs one
    /// (with `store_changes = "token"`: only the store changes over TCP).
    #[serde(deserialize_with = "tokens")]
    pub api_tokens: Vec<String>,
    /// Who may change the store (pull, push, create, copy, delete, blob uploads) over TCP.
    pub store_changes: StoreChanges,
    /// The largest request body accepted; 0 means no limit.
    #[serde(deserialize_with = "byte_size")]
    pub max_body: u64,
    /// When socket-activated: exit after this long with no model loaded and no request
    /// in flight (systemd keeps the sockets and starts corrald again). `None` is `"off"`.
    #[serde(deserialize_with = "off_or_duration")]
    pub exit_on_idle: Option<Duration>,
    /// A connection that has not sent a whole request head (line and headers) this long
    /// after it opened or after its last answer is closed.
    #[serde(deserialize_with = "positive_duration")]
    pub header_timeout: Duration,
    /// A request body that sends nothing for this long is aborted (a blob upload's
    /// partial file is removed).
    #[serde(deserialize_with = "positive_duration")]
    pub body_idle_timeout: Duration,
    /// Blob uploads (`/api/blobs/…`) at once; more are answered 503 with `Retry-After`.
    #[serde(deserialize_with = "positive_count")]
    pub max_uploads: u32,
    /// Pulls, pushes and creates over HTTP at once (`/api/pull`, `/api/push`,
    /// `/api/create`); more are answered 503 with `Retry-After`.
    #[serde(deserialize_with = "positive_count")]
    pub max_store_jobs: u32,
    /// A connection whose client takes none of an answer's bytes this long (it stopped
    /// reading) is closed, and its request ends.
    #[serde(deserialize_with = "positive_duration")]
    pub send_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let cors_origins = ["http", "https"]
            .into_iter()
            .flat_map(|scheme| {
                ["localhost", "127.0.0.1", "[::1]", "0.0.0.0"]
                    .into_iter()
                    .flat_map(move |host| [format!("{scheme}://{host}"), format!("{scheme}://{host}:*")])
            })
            .collect();
        Self {
            listen: vec![ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 11434)))],
            shutdown_timeout: Duration::from_secs(10),
            allowed_hosts: Vec::new(),
            cors_origins,
            api_tokens: Vec::new(),
            store_changes: StoreChanges::Any,
            max_body: 64 << 20,
            exit_on_idle: None,
            header_timeout: Duration::from_secs(10),
            body_idle_timeout: Duration::from_secs(60),
            max_uploads: 8,
            max_store_jobs: 16,
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// `[server] store_changes`: who may change the store over TCP. The UNIX socket (whose
/// mode and group decide who reaches it) and D-Bus (whose policy decides) are not affected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreChanges {
    /// Anyone who can connect, as with Ollama.
    #[default]
    Any,
    /// Only requests with a bearer token from `api_tokens`; then the tokens guard nothing else.
    Token,
    /// Nobody over TCP: changes go through the UNIX socket or D-Bus (`corralctl`).
    Unix,
}

/// `[store]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// The model store; `None` means `models/` in the state directory.
    #[serde(deserialize_with = "absolute_path_opt")]
    pub path: Option<PathBuf>,
    /// Use the store without writing to it (an Ollama models directory on a read-only
    /// mount): pull, create, copy and delete are refused.
    pub read_only: bool,
    /// Registries (`host` or `host:port`) spoken to over plain HTTP instead of HTTPS.
    pub insecure_registries: Vec<String>,
    /// How often garbage collection runs (once at start, then at this interval): blobs
    /// no model uses and partial downloads no pull runs. `None` is `"off"`: never.
    #[serde(deserialize_with = "off_or_duration")]
    pub gc_interval: Option<Duration>,
    /// How old an unused blob, a partial download or a temporary file must be before
    /// garbage collection removes it, so that an upload followed by the create that uses
    /// it, or a pull resumed soon after it failed, never loses its files.
    #[serde(deserialize_with = "duration")]
    pub gc_grace: Duration,
    /// Write uploaded and pulled blobs with direct I/O (`O_DIRECT`, where the file system
    /// has it): less CPU and no page cache filled with the blob. Each write waits for the
    /// disk, which costs more than it saves where the disk is the slower part: a transfer
    /// then goes on through the page cache (`store::stream::DirectPace`).
    pub direct_io: bool,
    /// Sync each new blob (upload, create, pull) before the request that made it answers;
    /// `false`: after, in the background (`store::unsynced`: a note on the disk lets the
    /// next start remove a blob the machine stopped before syncing), for a disk slow to sync.
    pub sync_before_reply: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            path: None,
            read_only: false,
            insecure_registries: Vec::new(),
            gc_interval: Some(Duration::from_secs(3600)),
            gc_grace: Duration::from_secs(3600),
            direct_io: true,
            sync_before_reply: true,
        }
    }
}

/// `[runner]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunnerConfig {
    /// The llama-server executable: a bare name is looked up on `PATH`.
    pub llama_server: PathBuf,
    /// llama.cpp's `llama-fit-params`, which projects a load's memory before it starts (a
    /// bare name is looked up on `PATH`); unset: `llama-fit-params` beside `llama_server`.
    /// Without it, loads are planned with corral's estimate.
    pub llama_fit_params: Option<PathBuf>,
    /// How long one projection may take before it is killed (and the estimate used).
    #[serde(deserialize_with = "positive_duration")]
    pub projection_timeout: Duration,
    /// A runner that sends nothing for this long in the middle of an answer is stopped,
    /// and the request ends with an error.
    #[serde(deserialize_with = "positive_duration")]
    pub stream_idle_timeout: Duration,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            llama_server: PathBuf::from("llama-server"),
            llama_fit_params: None,
            projection_timeout: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(5 * 60),
        }
    }
}

/// `[scheduler]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// How long a model stays loaded after its last request when the client does not say.
    #[serde(deserialize_with = "duration")]
    pub keep_alive: Duration,
    /// Most models loaded at once; 0 means three per GPU, at least three.
    pub max_loaded_models: u32,
    /// Most requests waiting for a model; more are refused with 503.
    pub max_queue: u32,
    /// The shortest keep-alive a client may ask for (an explicit 0, an unload, still counts).
    #[serde(deserialize_with = "duration_opt")]
    pub keep_alive_min: Option<Duration>,
    /// The longest keep-alive a client may ask for (forever becomes this).
    #[serde(deserialize_with = "duration_opt")]
    pub keep_alive_max: Option<Duration>,
    /// A load fails when llama-server prints nothing for this long.
    #[serde(deserialize_with = "duration")]
    pub load_timeout: Duration,
    /// The context per request slot when neither the model nor the client sets `num_ctx`.
    pub num_ctx: u32,
    /// Request slots per runner (`-np`).
    pub num_parallel: u32,
    /// Whether a model too big for the GPUs may run partly on the CPU (as Ollama does);
    /// with `false` such a load fails at once with the memory each device has.
    pub partial_offload: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            keep_alive: Duration::from_secs(5 * 60),
            max_loaded_models: 0,
            max_queue: 512,
            keep_alive_min: None,
            keep_alive_max: None,
            load_timeout: Duration::from_secs(5 * 60),
            num_ctx: 4096,
            num_parallel: 1,
            partial_offload: true,
        }
    }
}

/// `[gpu]`: where the device inventory comes from, and how much of each GPU is kept free.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// Use only `devices` and `host_memory` and probe no GPU (CPU-only hosts, tests).
    pub fixed: bool,
    /// With `fixed`: the host memory to plan with, in bytes; `None` reads `/proc/meminfo`.
    #[serde(deserialize_with = "byte_size_opt")]
    pub host_memory: Option<u64>,
    /// With `fixed`: the GPUs, indexed in this order.
    pub devices: Vec<FixedGpu>,
    /// Bytes kept free on every GPU, fixed or probed: taken off its total and free memory.
    #[serde(deserialize_with = "byte_size")]
    pub reserve: u64,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self { fixed: false, host_memory: None, devices: Vec::new(), reserve: 512 * 1024 * 1024 }
    }
}

/// One GPU of a fixed inventory: `[gpu] devices = [{ name = "test0", memory = "8GiB" }]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixedGpu {
    /// Its name in logs and listings.
    pub name: String,
    /// Its memory in bytes, all of it free.
    #[serde(deserialize_with = "byte_size")]
    pub memory: u64,
    /// Its driver family; CUDA when not given.
    #[serde(default = "default_backend", deserialize_with = "backend")]
    pub backend: crate::supervisor::command::Backend,
    /// Its id for the backend's visibility variable; its index when not given.
    #[serde(default)]
    pub id: Option<String>,
}

fn default_backend() -> crate::supervisor::command::Backend {
    crate::supervisor::command::Backend::Cuda
}

fn backend<'de, D: Deserializer<'de>>(d: D) -> Result<crate::supervisor::command::Backend, D::Error> {
    use crate::supervisor::command::Backend;
    match String::deserialize(d)?.as_str() {
        "cuda" => Ok(Backend::Cuda),
        "rocm" => Ok(Backend::Rocm),
        "vulkan" => Ok(Backend::Vulkan),
        other => Err(serde::de::Error::custom(format!(
            "\"{other}\" is not a GPU backend; expected \"cuda\", \"rocm\" or \"vulkan\""
        ))),
    }
}

/// One `[[workers]]` entry: a ggml `rpc-server` whose devices corral plans with.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Where it listens: `HOST:PORT`, the host an IPv4 address or a host name.
    pub address: WorkerAddress,
    /// Its name in logs and listings; its address when not given. Unique.
    #[serde(default, deserialize_with = "worker_name")]
    pub name: Option<String>,
    /// The most corral plans with on each of its devices (a shared worker, or a test's
    /// small device); all the memory it reports when not given.
    #[serde(default, deserialize_with = "byte_size_opt")]
    pub memory: Option<u64>,
    /// Allows an address that is not loopback or private: rpc-server has no
    /// authentication, so a public address is refused unless this says otherwise.
    #[serde(default)]
    pub allow_public: bool,
}

impl WorkerConfig {
    /// Its name: `name`, else its address.
    #[must_use]
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(self.address.as_str())
    }
}

/// A worker's `HOST:PORT`, checked: llama.cpp's RPC client splits it at the first colon
/// and connects over IPv4 (`gethostbyname`), and `--rpc` separates workers with commas.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerAddress(String);

impl WorkerAddress {
    /// The address as written: `HOST:PORT`.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its host when that is an IPv4 address (not a name).
    #[must_use]
    pub fn ip(&self) -> Option<std::net::Ipv4Addr> {
        self.0.rsplit_once(':').and_then(|(host, _)| host.parse().ok())
    }

    /// Its port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.0.rsplit_once(':').and_then(|(_, port)| port.parse().ok()).unwrap_or_default()
    }

    /// Its host: an IPv4 address or a name.
    #[must_use]
    pub fn host(&self) -> &str {
        self.0.rsplit_once(':').map_or(&self.0, |(host, _)| host)
    }
}

impl fmt::Display for WorkerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for WorkerAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let expected = "expected HOST:PORT with an IPv4 address or a host name, like \"127.0.0.1:50052\"";
        let Some((host, port)) = s.rsplit_once(':') else {
            return Err(format!("\"{s}\" has no port; {expected}"));
        };
        if host.starts_with('[') || host.parse::<std::net::Ipv6Addr>().is_ok() {
            return Err(format!("\"{s}\": llama.cpp's RPC client cannot reach IPv6 addresses; {expected}"));
        }
        if !port.bytes().all(|b| b.is_ascii_digit()) || !matches!(port.parse::<u16>(), Ok(1..)) {
            return Err(format!("\"{s}\": \"{port}\" is not a port (1 to 65535); {expected}"));
        }
        let looks_numeric = host.split('.').all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()));
        if looks_numeric {
            host.parse::<std::net::Ipv4Addr>()
                .map_err(|_| format!("\"{s}\": \"{host}\" is not an IPv4 address; {expected}"))?;
        } else if !is_host_name(host) {
            return Err(format!("\"{s}\": \"{host}\" is not a host name; {expected}"));
        }
        Ok(Self(s.to_owned()))
    }
}

impl<'de> Deserialize<'de> for WorkerAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A worker's name: a line of 1 to 64 printable characters (it goes into logs, listings
/// and D-Bus).
fn worker_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let name = String::deserialize(d)?;
    if name.trim().is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
        return Err(serde::de::Error::custom(format!(
            "{name:?} is not a worker name; expected 1 to 64 printable characters, like \"gpu-box\""
        )));
    }
    Ok(Some(name))
}

/// A host name as RFC 1123 has it: dot-separated labels of letters, digits and inner
/// hyphens, each at most 63 bytes, 253 in all.
fn is_host_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Parses a byte size with a unit: `"512MiB"`, `"8GiB"`, `"1.5GB"`, `"0"`.
///
/// Units are B, kB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024),
/// in any case; a bare number other than 0, or a one-letter unit like `"8G"`, is refused
/// as ambiguous.
fn parse_byte_size(s: &str) -> Result<u64, String> {
    let expected = "expected a number with a unit, like \"512MiB\", \"8GiB\" or \"1.5GB\"";
    let text = s.trim();
    if text == "0" {
        return Ok(0);
    }
    let unit = text.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.').trim_start();
    if unit.is_empty() {
        return Err(format!("\"{s}\" has no unit; {expected}"));
    }
    if !unit.ends_with(['b', 'B']) || unit.len() == text.len() {
        return Err(format!("\"{s}\" is not a byte size; {expected}"));
    }
    match text.parse::<bytesize::ByteSize>() {
        Ok(size) if size.as_u64() == u64::MAX => Err(format!("\"{s}\" is too large")),
        Ok(size) => Ok(size.as_u64()),
        Err(_) => Err(format!("\"{s}\" is not a byte size; {expected}")),
    }
}

fn byte_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    parse_byte_size(&String::deserialize(d)?).map_err(serde::de::Error::custom)
}

fn byte_size_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    byte_size(d).map(Some)
}

/// `[models."NAME"]`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelPolicy {
    /// Never evicted once loaded.
    pub pinned: bool,
    /// Loaded when the daemon starts.
    pub preload: bool,
    /// This model's keep-alive when the client does not say; `None` uses `[scheduler] keep_alive`.
    #[serde(deserialize_with = "duration_opt")]
    pub keep_alive: Option<Duration>,
}

/// A listen address from `[server] listen`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address with a port.
    Tcp(SocketAddr),
    /// An absolute path of a UNIX stream socket.
    Unix(PathBuf),
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(addr) => addr.fmt(f),
            Self::Unix(path) => path.display().fmt(f),
        }
    }
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.starts_with('/') {
            return Ok(Self::Unix(PathBuf::from(s)));
        }
        s.parse::<SocketAddr>().map(Self::Tcp).map_err(|_| {
            format!("\"{s}\" is neither an IP address with a port (\"127.0.0.1:11434\", \"[::1]:11434\") nor an absolute socket path")
        })
    }
}

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A duration as people write it, at most [`crate::durations::LONGEST`]: longer ones would
/// overflow the clock arithmetic of timers and keep-alives.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| {
        format!("\"{s}\" is not a duration ({e}); expected a number with a unit, like \"30s\", \"5m\" or \"1h30m\"")
    })?;
    if d > crate::durations::LONGEST {
        return Err(format!("\"{s}\" is longer than the longest duration corral takes, about 292 years"));
    }
    Ok(d)
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    parse_duration(&String::deserialize(d)?).map_err(serde::de::Error::custom)
}

fn duration_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

/// `"off"`, or a duration above zero.
fn off_or_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    if text == "off" {
        return Ok(None);
    }
    match parse_duration(&text) {
        Ok(d) if d.is_zero() => Err(format!("\"{text}\" is zero; say \"off\" to turn it off")),
        Ok(d) => Ok(Some(d)),
        Err(e) => Err(format!("{e}, or \"off\"")),
    }
    .map_err(serde::de::Error::custom)
}

/// A duration above zero.
fn positive_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    match parse_duration(&text) {
        Ok(d) if d.is_zero() => Err(format!("\"{text}\" is zero; expected a duration above zero, like \"10s\"")),
        other => other,
    }
    .map_err(serde::de::Error::custom)
}

/// A count of at least one.
fn positive_count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    match u32::deserialize(d)? {
        0 => Err(serde::de::Error::custom("0 would refuse everything; expected at least 1")),
        n => Ok(n),
    }
}

/// A list of strings, each passing `problem` (which says what is wrong with one); the error
/// quotes the entry.
fn each_checked<'de, D: Deserializer<'de>>(
    d: D,
    problem: fn(&str) -> Option<&'static str>,
) -> Result<Vec<String>, D::Error> {
    let entries = Vec::<String>::deserialize(d)?;
    if let Some((entry, why)) = entries.iter().find_map(|e| problem(e).map(|why| (e, why))) {
        return Err(serde::de::Error::custom(format!("\"{entry}\" {why}")));
    }
    Ok(entries)
}

/// `allowed_hosts`: each a host name or IP (a port is ignored), `"*.DOMAIN"`, or `"*"`;
/// a `*` anywhere else would never match, so it is refused rather than ignored.
fn host_patterns<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    each_checked(d, |host| {
        let rest = host.strip_prefix("*.").unwrap_or(host);
        if host.is_empty() {
            Some("is empty")
        } else if host != "*" && rest.contains('*') {
            Some("has a '*' that never matches: write \"*.example.org\" for a domain's hosts, or \"*\" for any")
        } else if host.contains("://") || host.contains('/') {
            Some("is not a host: write the name alone, as the Host header has it (\"example.org\")")
        } else if host.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("has a space or a control character, which no Host header has")
        } else {
            None
        }
    })
}

/// `cors_origins`: each `"*"`, or an origin as browsers send it (`scheme://host[:port]`,
/// no path) with at most one `*`; anything else would never match, so it is refused.
fn origin_patterns<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    each_checked(d, |origin| {
        let after_scheme = origin.split_once("://").map(|(_, rest)| rest);
        if origin == "*" {
            None
        } else if origin.matches('*').count() > 1 {
            Some("has more than one '*'")
        } else if after_scheme.is_none_or(str::is_empty) {
            Some("is not an origin: expected scheme://host[:port], like \"https://app.example.org\"")
        } else if after_scheme.is_some_and(|rest| rest.contains('/')) {
            Some("has a path, which an origin never has: leave out everything after the host and port")
        } else if origin.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("has a space or a control character, which no origin has")
        } else {
            None
        }
    })
}

/// `api_tokens`: each one or more printable ASCII characters without spaces, what an HTTP
/// header carries as it was written (a presented token is trimmed; an empty one would
/// match an empty header). The error names the token's place, never the token.
fn tokens<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let tokens = Vec::<String>::deserialize(d)?;
    for (i, token) in tokens.iter().enumerate() {
        let why = if token.is_empty() {
            "is empty"
        } else if !token.bytes().all(|b| b.is_ascii_graphic()) {
            "has a space or a character outside printable ASCII, which an HTTP header cannot carry as written"
        } else {
            continue;
        };
        return Err(serde::de::Error::custom(format!("token {} of {} {why}", i + 1, tokens.len())));
    }
    Ok(tokens)
}

fn absolute_path_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
    let path = PathBuf::deserialize(d)?;
    if path.is_absolute() {
        Ok(Some(path))
    } else {
        Err(serde::de::Error::custom(format!("\"{}\" is not an absolute path", path.display())))
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not valid TOML or does not match the schema.
    #[error("{}{}: {}{message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The line of the problem, when known.
        line: Option<usize>,
        /// The dotted key, when the problem is in a value (`scheduler.max_queue`).
        key: Option<String>,
        /// What is wrong and what was expected.
        message: String,
    },
}

/// Where a configuration comes from: the main file and whether it must exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSource {
    /// The main file; its drop-ins are `<file>.d/*.toml`.
    pub file: PathBuf,
    /// True for `--config PATH`: then a missing file is an error, not "use the defaults".
    pub required: bool,
}

/// A loaded configuration and the files it came from, in the order they were applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The merged configuration.
    pub config: Config,
    /// The files that were read.
    pub files: Vec<PathBuf>,
    /// The layers merged, before defaults are filled in: the keys the files (and the
    /// base) set, for telling which keys a reload changed.
    pub table: toml::Table,
}

impl ConfigSource {
    /// The drop-in directory of the main file.
    #[must_use]
    pub fn drop_in_dir(&self) -> PathBuf {
        let mut dir = self.file.clone().into_os_string();
        dir.push(".d");
        PathBuf::from(dir)
    }

    /// Reads, checks and merges all layers.
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        self.load_over(toml::Table::new())
    }

    /// [`ConfigSource::load`] on top of `base`, a layer between the built-in defaults and
    /// the files (`corrald --user` puts `[dbus] bus = "session"` there).
    pub fn load_over(&self, base: toml::Table) -> Result<Loaded, ConfigError> {
        let mut files = Vec::new();
        match std::fs::metadata(&self.file) {
            Ok(_) => files.push(self.file.clone()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !self.required => {}
            Err(source) => return Err(ConfigError::Read { path: self.file.clone(), source }),
        }
        files.extend(drop_ins(&self.drop_in_dir())?);

        let mut merged = base;
        for path in &files {
            let table = check_file(path)?;
            merge(&mut merged, table);
        }
        // Each layer matched the schema on its own, and a merge of valid tables is valid.
        let config = Config::deserialize(toml::Value::Table(merged.clone())).map_err(|e| ConfigError::Invalid {
            path: self.file.clone(),
            line: None,
            key: None,
            message: e.to_string(),
        })?;
        check_together(&config, &files)?;
        Ok(Loaded { config, files, table: merged })
    }
}

/// The rules between keys, checked on the merged configuration; the error names the
/// last file (and line) that set the key at fault.
fn check_together(config: &Config, files: &[PathBuf]) -> Result<(), ConfigError> {
    if config.server.store_changes == StoreChanges::Token && config.server.api_tokens.is_empty() {
        let (path, line) = where_set(files, "store_changes");
        return Err(ConfigError::Invalid {
            path,
            line,
            key: Some("server.store_changes".into()),
            message: "\"token\" needs at least one token in [server] api_tokens; add one, or say \"unix\" to \
                      allow changes over the UNIX socket only"
                .into(),
        });
    }
    check_workers(&config.workers, files)
}

/// Whether an IPv4 address is only reachable from this host or a private network:
/// loopback, RFC 1918, link-local, or shared address space (RFC 6598, carrier-grade NAT
/// and some VPNs).
#[must_use]
pub fn is_private_v4(ip: std::net::Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_loopback() || ip.is_private() || ip.is_link_local() || (a == 100 && (64..128).contains(&b))
}

/// Worker names (their addresses when unnamed) and addresses are unique: the error
/// names the last line that repeats one.
fn check_workers(workers: &[WorkerConfig], files: &[PathBuf]) -> Result<(), ConfigError> {
    let mut names = std::collections::HashSet::new();
    let mut addresses = std::collections::HashSet::new();
    for worker in workers {
        if let Some(ip) = worker.address.ip().filter(|ip| !worker.allow_public && !is_private_v4(*ip)) {
            let (path, line) = where_value(files, "address", worker.address.as_str());
            return Err(ConfigError::Invalid {
                path,
                line,
                key: Some("workers.address".into()),
                message: format!(
                    "{ip} is a public address: rpc-server has no authentication, so anyone who reaches it can \
                     run code there; use a loopback or private address (a private network or a VPN), or set \
                     allow_public = true in this [[workers]] entry"
                ),
            });
        }
        let (key, value, what) = if !addresses.insert(worker.address.as_str()) {
            ("address", worker.address.as_str(), "address")
        } else if !names.insert(worker.name()) {
            (if worker.name.is_some() { "name" } else { "address" }, worker.name(), "name")
        } else {
            continue;
        };
        let (path, line) = where_value(files, key, value);
        return Err(ConfigError::Invalid {
            path,
            line,
            key: Some(format!("workers.{key}")),
            message: format!(
                "two workers have the {what} \"{value}\"; each worker needs its own address and name \
                 (the name defaults to the address)"
            ),
        });
    }
    Ok(())
}

/// The last line of `files` that sets `key` to the string `value`, and its file.
fn where_value(files: &[PathBuf], key: &str, value: &str) -> (PathBuf, Option<usize>) {
    let quoted = [format!("\"{value}\""), format!("'{value}'")];
    for path in files.iter().rev() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let line = text.lines().collect::<Vec<_>>().iter().rposition(|l| {
            l.trim_start()
                .strip_prefix(key)
                .and_then(|rest| rest.trim_start().strip_prefix('='))
                .is_some_and(|rest| quoted.iter().any(|q| rest.trim_start().starts_with(q.as_str())))
        });
        if let Some(index) = line {
            return (path.clone(), Some(index + 1));
        }
    }
    (files.last().cloned().unwrap_or_default(), None)
}

/// The last of `files` with a line setting `key` (in any table), and that line.
fn where_set(files: &[PathBuf], key: &str) -> (PathBuf, Option<usize>) {
    for path in files.iter().rev() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let line = text
            .lines()
            .position(|l| l.trim_start().strip_prefix(key).is_some_and(|rest| rest.trim_start().starts_with('=')));
        if let Some(index) = line {
            return (path.clone(), Some(index + 1));
        }
    }
    (files.last().cloned().unwrap_or_default(), None)
}

/// The `*.toml` files of a drop-in directory in name order; a missing directory has none.
fn drop_ins(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(ConfigError::Read { path: dir.to_owned(), source }),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| ConfigError::Read { path: dir.to_owned(), source })?;
        let path = entry.path();
        if path.extension().is_some_and(|ext| ext == "toml") && !path.is_dir() {
            files.push(path);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// Parses one file and checks it against the schema on its own.
fn check_file(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
    let invalid = |span: Option<std::ops::Range<usize>>, key: Option<String>, message: &str| ConfigError::Invalid {
        path: path.to_owned(),
        line: span.map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1),
        key,
        message: message.trim().to_owned(),
    };
    let deserializer = toml::Deserializer::parse(&text).map_err(|e| invalid(e.span(), None, e.message()))?;
    match serde_path_to_error::deserialize::<_, Config>(deserializer) {
        Ok(_) => {}
        Err(e) => {
            let key = e.path().to_string();
            let key = (key != ".").then_some(key);
            let inner = e.into_inner();
            return Err(invalid(inner.span(), key, inner.message()));
        }
    }
    toml::from_str(&text).map_err(|e: toml::de::Error| invalid(e.span(), None, e.message()))
}

fn merge(into: &mut toml::Table, from: toml::Table) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(toml::Value::Table(existing)), toml::Value::Table(table)) => merge(existing, table),
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::time::Duration;

    use super::{BusKind, ConfigError, ConfigSource, ListenAddr, Loaded, Path, StoreChanges};

    fn source(dir: &Path) -> ConfigSource {
        ConfigSource { file: dir.join("corral.toml"), required: false }
    }

    fn load(files: &[(&str, &str)]) -> Result<Loaded, ConfigError> {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            let path = dir.path().join(name);
            fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            fs::write(path, text).expect("write");
        }
        source(dir.path()).load()
    }

    fn error(files: &[(&str, &str)]) -> String {
        load(files).expect_err("config should be rejected").to_string()
    }

    #[test]
    fn no_file_at_all_gives_the_defaults() {
        let loaded = load(&[]).expect("defaults");
        assert!(loaded.files.is_empty());
        let c = loaded.config;
        assert_eq!(c.server.listen, vec![ListenAddr::Tcp("127.0.0.1:11434".parse().expect("addr"))]);
        assert_eq!(c.scheduler.keep_alive, Duration::from_secs(300));
        assert_eq!(c.scheduler.max_queue, 512);
        assert_eq!(c.scheduler.max_loaded_models, 0);
        assert_eq!(c.runner.llama_server, Path::new("llama-server"));
        assert_eq!(c.runner.stream_idle_timeout, Duration::from_secs(300));
        assert_eq!(c.runner.llama_fit_params, None, "beside llama_server");
        assert_eq!(c.runner.projection_timeout, Duration::from_secs(30));
        assert_eq!(c.store.path, None);
        assert!(c.models.is_empty());
        assert!(c.server.allowed_hosts.is_empty() && c.server.api_tokens.is_empty());
        assert!(c.server.cors_origins.iter().any(|o| o == "http://localhost:*"));
        assert_eq!(c.server.max_body, 64 << 20);
        assert_eq!(c.dbus.bus, BusKind::System);
        assert_eq!(c.dbus.max_jobs, 16);
        assert_eq!(c.server.exit_on_idle, None);
        assert_eq!(c.server.header_timeout, Duration::from_secs(10));
        assert_eq!(c.server.body_idle_timeout, Duration::from_secs(60));
        assert_eq!(c.server.max_uploads, 8);
        assert_eq!(c.server.max_store_jobs, 16);
        assert_eq!(c.server.send_timeout, Duration::from_secs(60), "nginx's send_timeout");
        assert_eq!(c.server.store_changes, StoreChanges::Any, "Ollama's: anyone who reaches the port");
        assert_eq!(c.store.gc_interval, Some(Duration::from_secs(3600)));
        assert_eq!(c.store.gc_grace, Duration::from_secs(3600));
        assert!(c.store.direct_io && c.store.sync_before_reply, "direct I/O, blobs synced before the reply");
    }

    #[test]
    fn a_required_file_that_is_missing_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = ConfigSource { file: dir.path().join("nope.toml"), required: true };
        let err = src.load().expect_err("missing").to_string();
        assert!(err.contains("nope.toml: cannot read"), "{err}");
    }

    #[test]
    fn every_key_is_read() {
        let c = load(&[(
            "corral.toml",
            r#"
[server]
listen = ["127.0.0.1:8080", "[::1]:8081", "/run/corral.sock"]
shutdown_timeout = "3s"
allowed_hosts = ["corral.lan", "*.example.org"]
cors_origins = ["*"]
api_tokens = ["s3cret"]
store_changes = "token"
max_body = "1MiB"
exit_on_idle = "15m"
header_timeout = "5s"
body_idle_timeout = "2m"
max_uploads = 2
send_timeout = "20s"
[store]
path = "/srv/models"
read_only = true
insecure_registries = ["localhost:5000"]
gc_interval = "off"
gc_grace = "10m"
direct_io = false
sync_before_reply = false
[runner]
llama_server = "/opt/llama/bin/llama-server"
llama_fit_params = "/opt/llama/bin/llama-fit-params"
projection_timeout = "5s"
stream_idle_timeout = "90s"
[scheduler]
keep_alive = "1h30m"
max_loaded_models = 4
max_queue = 10
keep_alive_min = "1m"
keep_alive_max = "24h"
load_timeout = "10m"
num_ctx = 8192
num_parallel = 2
[gpu]
[dbus]
bus = "session"
max_jobs = 3
[models."qwen3:8b"]
pinned = true
preload = true
keep_alive = "10m"
"#,
        )])
        .expect("valid")
        .config;
        assert_eq!(c.server.listen.len(), 3);
        assert_eq!(c.server.listen[2], ListenAddr::Unix("/run/corral.sock".into()));
        assert_eq!(c.server.shutdown_timeout, Duration::from_secs(3));
        assert_eq!(c.server.allowed_hosts, ["corral.lan", "*.example.org"]);
        assert_eq!(c.server.cors_origins, ["*"]);
        assert_eq!(c.server.api_tokens, ["s3cret"]);
        assert_eq!(c.server.store_changes, StoreChanges::Token);
        assert_eq!(c.server.max_body, 1 << 20);
        assert_eq!(c.server.exit_on_idle, Some(Duration::from_secs(900)));
        assert_eq!(c.server.header_timeout, Duration::from_secs(5));
        assert_eq!(c.server.body_idle_timeout, Duration::from_secs(120));
        assert_eq!(c.server.max_uploads, 2);
        assert_eq!(c.server.send_timeout, Duration::from_secs(20));
        assert_eq!(c.store.path.as_deref(), Some(Path::new("/srv/models")));
        assert!(c.store.read_only);
        assert_eq!(c.store.insecure_registries, ["localhost:5000"]);
        assert_eq!((c.store.gc_interval, c.store.gc_grace), (None, Duration::from_secs(600)));
        assert!(!c.store.direct_io);
        assert!(!c.store.sync_before_reply);
        assert_eq!(c.runner.llama_server, Path::new("/opt/llama/bin/llama-server"));
        assert_eq!(c.runner.stream_idle_timeout, Duration::from_secs(90));
        assert_eq!(c.runner.llama_fit_params.as_deref(), Some(Path::new("/opt/llama/bin/llama-fit-params")));
        assert_eq!(c.runner.projection_timeout, Duration::from_secs(5));
        assert_eq!(c.scheduler.keep_alive, Duration::from_secs(5400));
        assert_eq!(c.scheduler.max_loaded_models, 4);
        assert_eq!(c.scheduler.max_queue, 10);
        assert_eq!(c.scheduler.keep_alive_min, Some(Duration::from_secs(60)));
        assert_eq!(c.scheduler.keep_alive_max, Some(Duration::from_secs(86_400)));
        assert_eq!(c.scheduler.load_timeout, Duration::from_secs(600));
        assert_eq!((c.scheduler.num_ctx, c.scheduler.num_parallel), (8192, 2));
        assert_eq!((c.dbus.bus, c.dbus.max_jobs), (BusKind::Session, 3));
        let m = &c.models["qwen3:8b"];
        assert!(m.pinned && m.preload);
        assert_eq!(m.keep_alive, Some(Duration::from_secs(600)));
    }

    #[test]
    fn drop_ins_apply_in_name_order_and_merge_tables() {
        let loaded = load(&[
            ("corral.toml", "[scheduler]\nmax_queue = 1\nkeep_alive = \"1m\"\n"),
            ("corral.toml.d/20-b.toml", "[scheduler]\nmax_queue = 3\n"),
            ("corral.toml.d/10-a.toml", "[scheduler]\nmax_queue = 2\n[server]\nlisten = [\"/a.sock\"]\n"),
            ("corral.toml.d/30-ignored.conf", "not toml at all"),
        ])
        .expect("valid");
        assert_eq!(loaded.files.len(), 3);
        assert!(loaded.files[1].ends_with("10-a.toml") && loaded.files[2].ends_with("20-b.toml"));
        assert_eq!(loaded.config.scheduler.max_queue, 3);
        assert_eq!(loaded.config.scheduler.keep_alive, Duration::from_secs(60), "untouched keys survive");
        assert_eq!(loaded.config.server.listen, vec![ListenAddr::Unix("/a.sock".into())]);
    }

    /// A token that cannot work is named by its place: the error goes to the journal and
    /// to whoever runs `--check-config`, and the token is a secret.
    #[test]
    fn a_bad_token_is_named_by_its_place_and_never_shown() {
        let err = error(&[("corral.toml", "[server]\napi_tokens = [\"s3cr3t-one\", \"s3cr3t two\"]\n")]);
        assert!(err.contains("server.api_tokens: token 2 of 2 has a space"), "{err}");
        assert!(!err.contains("s3cr3t"), "{err}");
        let good = "[server]\napi_tokens = [\"A-z0.9_~+/=\"]\n";
        assert_eq!(load(&[("corral.toml", good)]).expect("a token").config.server.api_tokens, ["A-z0.9_~+/="]);
    }

    #[test]
    fn store_changes_takes_three_modes_and_token_needs_tokens() {
        for (text, mode) in [("any", StoreChanges::Any), ("token", StoreChanges::Token), ("unix", StoreChanges::Unix)] {
            let file = format!("[server]\napi_tokens = [\"t\"]\nstore_changes = \"{text}\"\n");
            assert_eq!(load(&[("corral.toml", &file)]).expect(text).config.server.store_changes, mode);
        }
        let err = error(&[("corral.toml", "[server]\nstore_changes = \"root\"\n")]);
        assert!(err.contains("corral.toml:2") && err.contains("server.store_changes"), "{err}");
        assert!(err.contains("unknown variant `root`") && err.contains("`token`"), "{err}");
        // The token mode without tokens names the drop-in that asked for it, and its line.
        let err = error(&[
            ("corral.toml", "[server]\nmax_uploads = 2\n"),
            ("corral.toml.d/50-changes.toml", "# who may change the store\n[server]\nstore_changes = \"token\"\n"),
        ]);
        assert!(err.contains("50-changes.toml:3: server.store_changes: \"token\" needs"), "{err}");
        assert!(err.contains("api_tokens"), "{err}");
        // Tokens from another drop-in satisfy it.
        let loaded = load(&[
            ("corral.toml", "[server]\nstore_changes = \"token\"\n"),
            ("corral.toml.d/90-secret.toml", "[server]\napi_tokens = [\"s\"]\n"),
        ]);
        assert_eq!(loaded.expect("valid").config.server.store_changes, StoreChanges::Token);
    }

    #[test]
    fn drop_ins_apply_without_a_main_file() {
        let c = load(&[("corral.toml.d/a.toml", "[scheduler]\nmax_queue = 7\n")]).expect("valid").config;
        assert_eq!(c.scheduler.max_queue, 7);
    }

    /// Config files, and the texts their error must contain.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

    #[test]
    #[allow(clippy::too_many_lines)] // one table of cases
    fn errors_name_the_file_the_line_the_key_and_what_was_expected() {
        let cases: &[Case<'_>] = &[
            (
                &[("corral.toml", "[server]\nlisten = []\nlisen = 1\n")],
                &[
                    "corral.toml:3",
                    "server.lisen",
                    "unknown field `lisen`",
                    "expected one of `listen`, `shutdown_timeout`",
                ],
            ),
            (&[("corral.toml", "[nonsense]\n")], &["corral.toml:1", "nonsense", "unknown field `nonsense`"]),
            (
                &[("corral.toml", "[dbus]\nbus = \"user\"\n")],
                &["corral.toml:2", "dbus.bus", "unknown variant `user`", "`system`, `session`, `off`"],
            ),
            (
                &[("corral.toml", "[scheduler]\nmax_queue = \"many\"\n")],
                &["corral.toml:2", "scheduler.max_queue", "invalid type: string \"many\", expected u32"],
            ),
            (&[("corral.toml", "[scheduler]\nmax_queue = -1\n")], &["scheduler.max_queue", "-1"]),
            (
                &[("corral.toml", "[scheduler]\nkeep_alive = \"5\"\n")],
                &["scheduler.keep_alive", "\"5\" is not a duration", "\"5m\""],
            ),
            (&[("corral.toml", "[scheduler]\nkeep_alive = 300\n")], &["scheduler.keep_alive", "expected a string"]),
            // Past what clock arithmetic takes, in each kind of duration key.
            (
                &[("corral.toml", "[scheduler]\nkeep_alive = \"300000000000y\"\n")],
                &["corral.toml:2", "scheduler.keep_alive", "longer than the longest duration corral takes"],
            ),
            (
                &[("corral.toml", "[scheduler]\nkeep_alive_max = \"293y\"\n")],
                &["corral.toml:2", "scheduler.keep_alive_max", "\"293y\" is longer than"],
            ),
            (
                &[("corral.toml", "[models.\"m\"]\nkeep_alive = \"1000y\"\n")],
                &["corral.toml:2", "models.m.keep_alive", "longer than"],
            ),
            (
                &[("corral.toml", "[worker_health]\ntimeout = \"500y\"\n")],
                &["corral.toml:2", "worker_health.timeout", "longer than"],
            ),
            (
                &[("corral.toml", "[server]\nexit_on_idle = \"400y\"\n")],
                &["corral.toml:2", "server.exit_on_idle", "longer than"],
            ),
            (
                &[("corral.toml", "[server]\nlisten = [\"localhost:11434\"]\n")],
                &["server.listen", "neither an IP address with a port"],
            ),
            (&[("corral.toml", "[server]\nlisten = \"127.0.0.1:1\"\n")], &["server.listen", "expected a sequence"]),
            (
                &[("corral.toml", "[server]\nexit_on_idle = \"0s\"\n")],
                &["corral.toml:2", "server.exit_on_idle", "\"0s\" is zero", "\"off\""],
            ),
            (
                &[("corral.toml", "[server]\nexit_on_idle = \"soon\"\n")],
                &["corral.toml:2", "server.exit_on_idle", "\"soon\" is not a duration", "or \"off\""],
            ),
            (
                &[("corral.toml", "[server]\nexit_on_idle = false\n")],
                &["corral.toml:2", "server.exit_on_idle", "expected a string"],
            ),
            (
                &[("corral.toml", "[server]\nmax_body = \"64M\"\n")],
                &["corral.toml:2", "server.max_body", "is not a byte size"],
            ),
            (&[("corral.toml", "[server]\napi_tokens = \"t\"\n")], &["server.api_tokens", "expected a sequence"]),
            (
                &[("corral.toml", "[server]\napi_tokens = [\"secret\", \"\"]\n")],
                &["corral.toml:2", "server.api_tokens", "token 2 of 2 is empty"],
            ),
            (
                &[("corral.toml", "[server]\napi_tokens = [\" secret\"]\n")],
                &["corral.toml:2", "server.api_tokens", "token 1 of 1 has a space"],
            ),
            (
                &[("corral.toml", "[server]\napi_tokens = [\"sécret\"]\n")],
                &["corral.toml:2", "server.api_tokens", "outside printable ASCII"],
            ),
            (
                &[("corral.toml", "[server]\ncors_origins = [\"https://*.example.org:*\"]\n")],
                &["corral.toml:2", "server.cors_origins", "more than one '*'"],
            ),
            (
                &[("corral.toml", "[server]\ncors_origins = [\"https://app.example.org/\"]\n")],
                &["corral.toml:2", "server.cors_origins", "has a path"],
            ),
            (
                &[("corral.toml", "[server]\ncors_origins = [\"app.example.org\"]\n")],
                &["corral.toml:2", "server.cors_origins", "is not an origin"],
            ),
            (
                &[("corral.toml", "[server]\nallowed_hosts = [\"*example.org\"]\n")],
                &["corral.toml:2", "server.allowed_hosts", "never matches"],
            ),
            (
                &[("corral.toml", "[server]\nallowed_hosts = [\"https://example.org\"]\n")],
                &["corral.toml:2", "server.allowed_hosts", "is not a host"],
            ),
            (&[("corral.toml", "[server]\nallowed_hosts = [\"\"]\n")], &["server.allowed_hosts", "is empty"]),
            (
                &[("corral.toml", "[server]\nheader_timeout = \"0s\"\n")],
                &["corral.toml:2", "server.header_timeout", "\"0s\" is zero", "above zero"],
            ),
            (
                &[("corral.toml", "[server]\nbody_idle_timeout = \"a minute\"\n")],
                &["corral.toml:2", "server.body_idle_timeout", "is not a duration"],
            ),
            (
                &[("corral.toml", "[server]\nbody_idle_timeout = 60\n")],
                &["server.body_idle_timeout", "expected a string"],
            ),
            (
                &[("corral.toml", "[server]\nmax_uploads = 0\n")],
                &["corral.toml:2", "server.max_uploads", "expected at least 1"],
            ),
            (&[("corral.toml", "[server]\nmax_uploads = -2\n")], &["server.max_uploads", "-2"]),
            (
                &[("corral.toml", "[server]\nmax_store_jobs = 0\n")],
                &["corral.toml:2", "server.max_store_jobs", "expected at least 1"],
            ),
            (
                &[("corral.toml", "[server]\nsend_timeout = \"0s\"\n")],
                &["corral.toml:2", "server.send_timeout", "\"0s\" is zero", "above zero"],
            ),
            (&[("corral.toml", "[server]\nsend_timeout = \"off\"\n")], &["server.send_timeout", "\"off\""]),
            (&[("corral.toml", "[dbus]\nmax_jobs = 0\n")], &["corral.toml:2", "dbus.max_jobs", "expected at least 1"]),
            (&[("corral.toml", "[dbus]\nmax_jobs = \"many\"\n")], &["dbus.max_jobs", "many"]),
            (&[("corral.toml", "[server]\nallowed_hosts = [1]\n")], &["server.allowed_hosts", "expected a string"]),
            (&[("corral.toml", "[store]\npath = \"models\"\n")], &["store.path", "not an absolute path"]),
            (
                &[("corral.toml", "[store]\ngc_interval = \"0s\"\n")],
                &["corral.toml:2", "store.gc_interval", "\"0s\" is zero", "\"off\""],
            ),
            (
                &[("corral.toml", "[store]\ngc_interval = \"hourly\"\n")],
                &["corral.toml:2", "store.gc_interval", "\"hourly\" is not a duration", "or \"off\""],
            ),
            (
                &[("corral.toml", "[store]\ngc_grace = \"1\"\n")],
                &["corral.toml:2", "store.gc_grace", "\"1\" is not a duration"],
            ),
            (&[("corral.toml", "[store]\ngc_grace = 60\n")], &["store.gc_grace", "expected a string"]),
            (&[("corral.toml", "[store]\ndirect_io = \"no\"\n")], &["store.direct_io", "expected a boolean"]),
            (
                &[("corral.toml", "[store]\nsync_before_reply = 1\n")],
                &["corral.toml:2", "store.sync_before_reply", "expected a boolean"],
            ),
            (
                &[("corral.toml", "[runner]\nstream_idle_timeout = \"0s\"\n")],
                &["corral.toml:2", "runner.stream_idle_timeout", "\"0s\" is zero"],
            ),
            (
                &[("corral.toml", "[runner]\nstream_idle_timeout = \"soon\"\n")],
                &["corral.toml:2", "runner.stream_idle_timeout", "\"soon\" is not a duration"],
            ),
            (
                &[("corral.toml", "[runner]\nstream_idle_timeout = 30\n")],
                &["corral.toml:2", "runner.stream_idle_timeout", "expected a string"],
            ),
            (
                &[("corral.toml", "[runner]\nprojection_timeout = \"0s\"\n")],
                &["corral.toml:2", "runner.projection_timeout", "\"0s\" is zero"],
            ),
            (
                &[("corral.toml", "[runner]\nprojection_timeout = \"half a minute\"\n")],
                &["corral.toml:2", "runner.projection_timeout", "is not a duration"],
            ),
            (
                &[("corral.toml", "[runner]\nprojection_timeout = 30\n")],
                &["runner.projection_timeout", "expected a string"],
            ),
            (&[("corral.toml", "[runner]\nllama_fit_params = 1\n")], &["runner.llama_fit_params", "expected"]),
            (
                &[("corral.toml", "[runner]\nllama_fit_param = \"x\"\n")],
                &["corral.toml:2", "runner.llama_fit_param", "unknown field", "`llama_fit_params`"],
            ),
            (&[("corral.toml", "[models.\"a\"]\npinned = \"yes\"\n")], &["models.a.pinned", "expected a boolean"]),
            (&[("corral.toml", "[server\n")], &["corral.toml:1", "unclosed table, expected `]`"]),
            (
                &[
                    ("corral.toml", "[runner]\nllama_server = \"x\"\n"),
                    ("corral.toml.d/50-bad.toml", "[runner]\nthreads = 4\n"),
                ],
                &["50-bad.toml:2", "runner.threads", "unknown field `threads`"],
            ),
        ];
        for (files, wanted) in cases {
            let err = error(files);
            for w in *wanted {
                assert!(err.contains(w), "error for {files:?} should contain {w:?}: {err}");
            }
        }
    }

    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * MIB;

    #[test]
    fn gpu_defaults_probe_with_a_512_mib_reserve() {
        let gpu = load(&[]).expect("defaults").config.gpu;
        assert_eq!(gpu, super::GpuConfig { fixed: false, host_memory: None, devices: Vec::new(), reserve: 512 * MIB });
        assert_eq!(load(&[("corral.toml", "[gpu]\n")]).expect("valid").config.gpu, gpu);
    }

    #[test]
    fn gpu_keys_are_read() {
        use super::FixedGpu;
        use crate::supervisor::command::Backend;
        let gpu = load(&[(
            "corral.toml",
            r#"
[gpu]
fixed = true
host_memory = "16GiB"
devices = [
  { name = "test0", memory = "8GiB" },
  { name = "test1", memory = "1.5GB", backend = "rocm", id = "GPU-abc" },
  { name = "test2", memory = "512 MiB", backend = "vulkan" },
]
reserve = "0"
"#,
        )])
        .expect("valid")
        .config
        .gpu;
        assert!(gpu.fixed);
        assert_eq!(gpu.host_memory, Some(16 * GIB));
        assert_eq!(gpu.reserve, 0);
        assert_eq!(
            gpu.devices,
            [
                FixedGpu { name: "test0".into(), memory: 8 * GIB, backend: Backend::Cuda, id: None },
                FixedGpu {
                    name: "test1".into(),
                    memory: 1_500_000_000,
                    backend: Backend::Rocm,
                    id: Some("GPU-abc".into())
                },
                FixedGpu { name: "test2".into(), memory: 512 * MIB, backend: Backend::Vulkan, id: None },
            ]
        );
    }

    #[test]
    fn gpu_keys_layer_like_the_others() {
        let gpu = load(&[
            ("corral.toml", "[gpu]\nfixed = true\ndevices = [{ name = \"a\", memory = \"1GiB\" }]\n"),
            ("corral.toml.d/10-host.toml", "[gpu]\nhost_memory = \"2GiB\"\nreserve = \"1MiB\"\n"),
        ])
        .expect("valid")
        .config
        .gpu;
        assert!(gpu.fixed);
        assert_eq!((gpu.devices.len(), gpu.host_memory, gpu.reserve), (1, Some(2 * GIB), MIB));
    }

    #[test]
    fn workers_are_read_with_their_defaults() {
        assert!(load(&[]).expect("defaults").config.workers.is_empty(), "no worker unless configured");
        let workers = load(&[(
            "corral.toml",
            r#"
[[workers]]
address = "127.0.0.1:50052"

[[workers]]
address = "gpu-box.lan:50053"
name = "gpu-box"
memory = "200MiB"
"#,
        )])
        .expect("valid")
        .config
        .workers;
        let [a, b] = &workers[..] else { panic!("two workers: {workers:?}") };
        assert_eq!((a.address.as_str(), a.name.as_deref(), a.memory), ("127.0.0.1:50052", None, None));
        assert_eq!(a.name(), "127.0.0.1:50052", "the name defaults to the address");
        assert!(!a.allow_public, "public addresses are refused by default");
        assert_eq!(
            (b.address.to_string(), b.name(), b.memory),
            ("gpu-box.lan:50053".to_owned(), "gpu-box", Some(200 * MIB))
        );
    }

    #[test]
    fn only_loopback_and_private_worker_addresses_pass_without_allow_public() {
        for private in [
            "127.0.0.1",
            "127.9.9.9",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.0.1",
            "100.64.0.1",
            "100.127.255.255",
        ] {
            assert!(super::is_private_v4(private.parse().expect("ip")), "{private}");
        }
        for public in [
            "8.8.8.8",
            "172.32.0.1",
            "172.15.255.255",
            "192.169.0.1",
            "100.128.0.1",
            "100.63.255.255",
            "1.1.1.1",
            "0.0.0.0",
            "255.255.255.255",
        ] {
            assert!(!super::is_private_v4(public.parse().expect("ip")), "{public}");
        }
        let allowed = load(&[("corral.toml", "[[workers]]\naddress = \"8.8.8.8:50052\"\nallow_public = true\n")])
            .expect("allowed explicitly");
        assert!(allowed.config.workers[0].allow_public);
        let health = load(&[("corral.toml", "[worker_health]\ninterval = \"1s\"\ntimeout = \"500ms\"\n")])
            .expect("valid")
            .config
            .worker_health;
        assert_eq!((health.interval, health.timeout), (Duration::from_secs(1), Duration::from_millis(500)));
        let defaults = load(&[]).expect("defaults").config.worker_health;
        assert_eq!((defaults.interval, defaults.timeout), (Duration::from_secs(10), Duration::from_secs(3)));
    }

    #[test]
    fn worker_addresses_are_ipv4_or_host_names_with_a_port() {
        for good in ["127.0.0.1:50052", "localhost:1", "a-b.example.org:65535", "10.0.0.2:50052", "x:8"] {
            assert_eq!(good.parse::<super::WorkerAddress>().map(|a| a.to_string()), Ok(good.to_owned()), "{good}");
        }
        let bad: &[(&str, &str)] = &[
            ("127.0.0.1", "has no port"),
            ("", "has no port"),
            ("127.0.0.1:", "is not a port"),
            ("127.0.0.1:0", "is not a port"),
            ("127.0.0.1:65536", "is not a port"),
            ("127.0.0.1:+5", "is not a port"),
            ("127.0.0.1:5x", "is not a port"),
            ("[::1]:50052", "IPv6"),
            ("::1:50052", "IPv6"),
            ("256.0.0.1:50052", "is not an IPv4 address"),
            ("1.2.3:50052", "is not an IPv4 address"),
            (":50052", "is not a host name"),
            ("a,b:50052", "is not a host name"),
            ("-a:50052", "is not a host name"),
            ("a..b:50052", "is not a host name"),
            ("a b:50052", "is not a host name"),
            ("http://a:50052", "is not a"),
        ];
        for (text, want) in bad {
            let err = text.parse::<super::WorkerAddress>().expect_err(text);
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(err.contains("like \"127.0.0.1:50052\""), "{err}");
        }
    }

    #[test]
    fn worker_errors_name_the_file_the_line_and_the_key() {
        let cases: &[Case<'_>] = &[
            (
                &[("corral.toml", "[[workers]]\naddress = \"127.0.0.1\"\n")],
                &["corral.toml:2", "workers[0].address", "\"127.0.0.1\" has no port"],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"127.0.0.1:1\"\n[[workers]]\naddress = \"[::1]:2\"\n")],
                &["corral.toml:4", "workers[1].address", "IPv6"],
            ),
            (&[("corral.toml", "[[workers]]\nname = \"a\"\n")], &["workers[0]", "missing field `address`"]),
            (
                &[("corral.toml", "[[workers]]\naddress = \"h:1\"\nname = \"\"\n")],
                &["corral.toml:3", "workers[0].name", "\"\" is not a worker name", "1 to 64 printable"],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"h:1\"\nname = \"a\\nb\"\n")],
                &["corral.toml:3", "workers[0].name", "is not a worker name"],
            ),
            (&[("corral.toml", "[[workers]]\naddress = 50052\n")], &["workers[0].address", "expected a string"]),
            (
                &[("corral.toml", "[[workers]]\naddress = \"h:1\"\nmemory = \"200M\"\n")],
                &["corral.toml:3", "workers[0].memory", "\"200M\" is not a byte size"],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"h:1\"\nport = 1\n")],
                &["corral.toml:3", "workers[0].port", "unknown field `port`", "`address`, `name`, `memory`"],
            ),
            (&[("corral.toml", "[workers]\naddress = \"h:1\"\n")], &["workers", "expected a sequence"]),
            (
                &[(
                    "corral.toml",
                    "[[workers]]\naddress = \"h:1\"\nname = \"w\"\n[[workers]]\naddress = \"h:2\"\nname = \"w\"\n",
                )],
                &["corral.toml:6", "workers.name", "two workers have the name \"w\""],
            ),
            (
                &[
                    ("corral.toml", "[[workers]]\naddress = \"h:1\"\n"),
                    ("corral.toml.d/10-more.toml", "[[workers]]\naddress = \"h:1\"\n[[workers]]\naddress = \"h:1\"\n"),
                ],
                &["10-more.toml:4", "workers.address", "the address \"h:1\""],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"h:1\"\n[[workers]]\naddress = \"h:2\"\nname = \"h:1\"\n")],
                &["corral.toml:5", "workers.name", "the name \"h:1\""],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"10.0.0.2:1\"\n[[workers]]\naddress = \"8.8.8.8:50052\"\n")],
                &["corral.toml:4", "workers.address", "8.8.8.8 is a public address", "allow_public = true"],
            ),
            (
                &[("corral.toml", "[[workers]]\naddress = \"10.0.0.2:1\"\nallow_public = \"yes\"\n")],
                &["corral.toml:3", "workers[0].allow_public", "expected a boolean"],
            ),
            (&[("corral.toml", "[worker_health]\ninterval = \"0s\"\n")], &["worker_health.interval", "is zero"]),
            (
                &[("corral.toml", "[worker_health]\ntimeout = \"soon\"\n")],
                &["corral.toml:2", "worker_health.timeout", "\"soon\""],
            ),
            (&[("corral.toml", "[worker_health]\nevery = \"1s\"\n")], &["unknown field `every`", "`interval`"]),
        ];
        for (files, wanted) in cases {
            let err = error(files);
            for w in *wanted {
                assert!(err.contains(w), "error for {files:?} should contain {w:?}: {err}");
            }
        }
    }

    #[test]
    fn byte_sizes_need_a_unit() {
        let good: &[(&str, u64)] = &[
            ("0", 0),
            ("0B", 0),
            ("512MiB", 512 * MIB),
            ("8GiB", 8 * GIB),
            ("8gib", 8 * GIB),
            ("8 GiB", 8 * GIB),
            (" 8GiB ", 8 * GIB),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 * GIB / 2),
            ("100kB", 100_000),
            ("1TiB", 1024 * GIB),
            ("123B", 123),
        ];
        for (text, want) in good {
            assert_eq!(super::parse_byte_size(text), Ok(*want), "{text:?}");
        }
        let bad: &[(&str, &str)] = &[
            ("", "no unit"),
            ("8", "no unit"),
            ("1.5", "no unit"),
            ("8G", "not a byte size"),
            ("8Gi", "not a byte size"),
            ("GiB", "not a byte size"),
            ("-1GiB", "not a byte size"),
            ("8 gigabytes", "not a byte size"),
            ("8XB", "not a byte size"),
            ("1.2.3GB", "not a byte size"),
            ("99999999999EiB", "too large"),
        ];
        for (text, want) in bad {
            let err = super::parse_byte_size(text).expect_err(text);
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(*want == "too large" || err.contains("like \"512MiB\", \"8GiB\" or \"1.5GB\""), "{err}");
        }
    }

    #[test]
    fn gpu_errors_name_the_key_and_the_expected_form() {
        let cases: &[Case<'_>] = &[
            (
                &[("corral.toml", "[gpu]\nfixed = true\nreserv = \"1GiB\"\n")],
                &["corral.toml:3", "gpu.reserv", "unknown field `reserv`", "`reserve`"],
            ),
            (
                &[("corral.toml", "[gpu]\nreserve = \"lots\"\n")],
                &["corral.toml:2", "gpu.reserve", "\"lots\" is not a byte size", "\"512MiB\""],
            ),
            (&[("corral.toml", "[gpu]\nreserve = 512\n")], &["gpu.reserve", "expected a string"]),
            (&[("corral.toml", "[gpu]\nhost_memory = \"16\"\n")], &["gpu.host_memory", "\"16\" has no unit"]),
            (&[("corral.toml", "[gpu]\nfixed = \"yes\"\n")], &["gpu.fixed", "expected a boolean"]),
            (
                &[("corral.toml", "[gpu]\ndevices = [{ name = \"a\", memory = \"8G\" }]\n")],
                &["corral.toml:2", "gpu.devices[0].memory", "\"8G\" is not a byte size"],
            ),
            (
                &[("corral.toml", "[gpu]\ndevices = [{ name = \"a\" }]\n")],
                &["gpu.devices[0]", "missing field `memory`"],
            ),
            (
                &[("corral.toml", "[gpu]\ndevices = [{ memory = \"1GiB\" }]\n")],
                &["gpu.devices[0]", "missing field `name`"],
            ),
            (
                &[("corral.toml", "[gpu]\ndevices = [{ name = \"a\", memory = \"1GiB\", vram = 1 }]\n")],
                &["gpu.devices[0].vram", "unknown field `vram`"],
            ),
            (
                &[("corral.toml", "[gpu]\ndevices = [{ name = \"a\", memory = \"1GiB\", backend = \"opencl\" }]\n")],
                &["gpu.devices[0].backend", "\"opencl\" is not a GPU backend", "\"cuda\", \"rocm\" or \"vulkan\""],
            ),
            (
                &[("corral.toml", "[gpu]\n"), ("corral.toml.d/gpu.toml", "[gpu]\nhost_memory = \"1.5\"\n")],
                &["gpu.toml:2", "gpu.host_memory", "has no unit"],
            ),
        ];
        for (files, wanted) in cases {
            let err = error(files);
            for w in *wanted {
                assert!(err.contains(w), "error for {files:?} should contain {w:?}: {err}");
            }
        }
    }
}
