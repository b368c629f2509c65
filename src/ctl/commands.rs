//! The D-Bus commands: list, ps, show, load, unload, pull, push, create, cp, rm, status.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Serialize;
use zbus::zvariant::{Fd, OwnedObjectPath, Value};

use super::bus::{Bus, OrBus};
use super::chat::Api;
use super::cli::{LoadArgs, TransferArgs};
use super::error::CtlError;
use super::job::{Outcome, Progress, Watch};
use super::modelfile;
use super::output::{self, expires, expires_rfc3339, fields, print, print_json, short_digest, size, table};

/// How results are shown.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    /// `--json`.
    pub json: bool,
    /// Whether standard output is a terminal (progress bars).
    pub terminal: bool,
}

impl Style {
    fn progress(self, bar: bool) -> Progress {
        if self.json {
            Progress::Quiet
        } else if self.terminal && bar {
            Progress::Bar
        } else {
            Progress::Lines
        }
    }
}

/// One stored model, as `list` shows it.
#[derive(Debug, Serialize)]
pub struct Listed {
    /// Its name.
    pub name: String,
    /// The manifest digest.
    pub digest: String,
    /// Bytes of its blobs.
    pub size: u64,
    /// stopped, loading, ready, unloading or failed.
    pub state: String,
}

/// A model's properties, as `show` and `ps` show them.
#[derive(Debug, Serialize)]
pub struct ModelInfo {
    /// Full name.
    pub name: String,
    /// Name as Ollama shows it.
    pub short_name: String,
    /// Manifest digest.
    pub digest: String,
    /// Bytes of its blobs.
    pub size: u64,
    /// format, family, parameter size, quantization.
    pub details: BTreeMap<String, String>,
    /// When its manifest was written (RFC 3339).
    pub modified_at: Option<String>,
    /// Its system prompt; empty for none.
    pub system: String,
    /// Its default options, `name value` lines.
    pub parameters: String,
    /// The context its weights were trained for; 0 when unknown.
    pub context_length: u64,
    /// completion or embedding, tools, insert, vision.
    pub capabilities: Vec<String>,
    /// stopped, loading, ready, unloading or failed.
    pub state: String,
    /// Why the last load or run failed.
    pub last_error: String,
    /// The llama-server process; 0 when not ready.
    pub pid: u32,
    /// Layers on GPUs.
    pub gpu_layers: u32,
    /// All layers.
    pub total_layers: u32,
    /// Memory on GPUs.
    pub vram_bytes: u64,
    /// Host memory.
    pub ram_bytes: u64,
    /// The other models served by the same llama-server process.
    pub shared_with: Vec<String>,
    /// Where its memory is, device by device, the host last.
    pub devices: Vec<ModelDevice>,
    /// When an idle model unloads (RFC 3339); `None` for not at all.
    pub expires_at: Option<String>,
    /// Requests holding it.
    pub active_requests: u32,
    /// Its memory on each device: planned before the load and actual.
    pub memory: Vec<DeviceMemory>,
    #[serde(skip)]
    expires_micros: u64,
}

/// One device's memory for a loaded model, as `show` prints it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    /// The device as llama.cpp names it, or `Host`.
    pub device: String,
    /// Bytes planned (0: the plan did not name it).
    pub planned: u64,
    /// Bytes llama.cpp allocated.
    pub actual: u64,
}

/// A model's memory on one device.
#[derive(Debug, Serialize)]
pub struct ModelDevice {
    /// The device's stable id, as `status` lists it (`host` for host memory).
    pub name: String,
    /// cuda, rocm, vulkan, rpc or host.
    pub kind: String,
    /// Bytes of the model there.
    pub bytes: u64,
}

/// A device, as `status` shows it.
#[derive(Debug, Serialize)]
pub struct DeviceInfo {
    /// cuda, rocm, vulkan, rpc or host.
    pub kind: String,
    /// Stable id.
    pub name: String,
    /// Product name, or the worker's name.
    pub description: String,
    /// Bytes in all.
    pub total_bytes: u64,
    /// Bytes corral may plan with.
    pub usable_bytes: u64,
    /// Bytes corral's runners use now.
    pub used_bytes: u64,
}

/// A GPU, as `status` shows it.
#[derive(Debug, Serialize)]
pub struct GpuInfo {
    /// Stable id.
    pub id: String,
    /// Product name.
    pub name: String,
    /// cuda, rocm or vulkan.
    pub driver: String,
    /// Bytes in all.
    pub total_bytes: u64,
    /// Bytes corral may use at start.
    pub usable_bytes: u64,
}

/// The daemon, as `status` shows it.
#[derive(Debug, Serialize)]
pub struct Status {
    /// corrald's version.
    pub version: String,
    /// GPUs found at start (superseded by `devices`).
    pub gpus: Vec<GpuInfo>,
    /// Every device, the host last, with what corral uses on it.
    pub devices: Vec<DeviceInfo>,
    /// Every configured RPC worker, with its health.
    pub workers: Vec<WorkerInfo>,
    /// Host memory for models, in bytes.
    pub host_memory: u64,
    /// Models loading, ready or unloading.
    pub loaded_models: Vec<String>,
    /// Requests waiting for a load.
    pub queue_depth: u32,
    /// The most runners at once.
    pub max_loaded_models: u32,
    /// The most waiting requests.
    pub max_queue: u32,
    /// Seconds an idle model stays loaded; -1 for forever.
    pub default_keep_alive: i64,
}

/// One RPC worker, as `status` shows it.
#[derive(Debug, Serialize)]
pub struct WorkerInfo {
    /// Its name.
    pub name: String,
    /// Its `HOST:PORT`.
    pub address: String,
    /// "up" or "down".
    pub state: String,
    /// Its devices' names.
    pub devices: Vec<String>,
    /// Why it is down; empty when up.
    pub last_error: String,
    /// The last check's connection time in microseconds (0: none yet).
    pub rtt_usec: u64,
}

/// `list`.
pub async fn list(bus: &Bus, style: Style) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let models: Vec<Listed> = manager
        .list_models()
        .await
        .or_bus(bus)?
        .into_iter()
        .map(|(name, _, digest, size, state)| Listed { name, digest, size, state })
        .collect();
    // corrald lists the newest first, as `ollama list` does; the order is kept.
    if style.json {
        return print_json(&models);
    }
    let rows: Vec<Vec<String>> =
        models.iter().map(|m| vec![m.name.clone(), short_digest(&m.digest), size(m.size), m.state.clone()]).collect();
    print(&table(&["NAME", "ID", "SIZE", "STATE"], &rows))
}

/// Reads every property of the model at `path`.
async fn model_info(bus: &Bus, path: OwnedObjectPath) -> Result<ModelInfo, CtlError> {
    let m = bus.model(path).await?;
    let expires_micros = m.expires_at().await.or_bus(bus)?;
    Ok(ModelInfo {
        name: m.name().await.or_bus(bus)?,
        short_name: m.short_name().await.or_bus(bus)?,
        digest: m.digest().await.or_bus(bus)?,
        size: m.size().await.or_bus(bus)?,
        details: m.details().await.or_bus(bus)?.into_iter().collect(),
        modified_at: expires_rfc3339(m.modified_at().await.or_bus(bus)?),
        system: m.system().await.or_bus(bus)?,
        parameters: m.parameters().await.or_bus(bus)?,
        context_length: m.context_length().await.or_bus(bus)?,
        capabilities: m.capabilities().await.or_bus(bus)?,
        state: m.state().await.or_bus(bus)?,
        last_error: m.last_error().await.or_bus(bus)?,
        pid: m.pid().await.or_bus(bus)?,
        gpu_layers: m.gpu_layers().await.or_bus(bus)?,
        total_layers: m.total_layers().await.or_bus(bus)?,
        vram_bytes: m.vram_bytes().await.or_bus(bus)?,
        ram_bytes: m.ram_bytes().await.or_bus(bus)?,
        shared_with: m.shared_with().await.or_bus(bus)?,
        devices: m
            .devices()
            .await
            .or_bus(bus)?
            .into_iter()
            .map(|(name, kind, bytes)| ModelDevice { name, kind, bytes })
            .collect(),
        expires_at: expires_rfc3339(expires_micros),
        active_requests: m.active_requests().await.or_bus(bus)?,
        memory: m
            .memory()
            .await
            .or_bus(bus)?
            .into_iter()
            .map(|(device, planned, actual)| DeviceMemory { device, planned, actual })
            .collect(),
        expires_micros,
    })
}

/// `ps`.
pub async fn ps(bus: &Bus, style: Style) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let labels = device_labels(&manager.devices().await.or_bus(bus)?);
    let mut loaded = Vec::new();
    for name in manager.loaded_models().await.or_bus(bus)? {
        // A model unloaded between the two calls is simply not shown.
        match manager.get_model(&name).await {
            Ok(path) => loaded.push(model_info(bus, path).await?),
            Err(e) => match bus.error(e) {
                CtlError::Daemon { name, .. } if name == "NoSuchModel" => {}
                other => return Err(other),
            },
        }
    }
    if style.json {
        return print_json(&loaded);
    }
    let now = SystemTime::now();
    let rows: Vec<Vec<String>> = loaded
        .iter()
        .map(|m| {
            vec![
                m.short_name.clone(),
                m.state.clone(),
                if m.pid == 0 { "-".to_owned() } else { m.pid.to_string() },
                placement(&m.devices, &labels),
                m.active_requests.to_string(),
                expires(m.expires_micros, now),
                if m.shared_with.is_empty() { "-".to_owned() } else { m.shared_with.join(", ") },
            ]
        })
        .collect();
    print(&narrow(&["NAME", "STATE", "PID", "PLACEMENT", "ACTIVE", "UNTIL", "SHARED WITH"], rows))
}

/// A table within 80 columns where it can be: the ACTIVE column gives way first, then PID
/// (`--json` has them all).
fn narrow(headers: &[&str], mut rows: Vec<Vec<String>>) -> String {
    let mut headers = headers.to_vec();
    let mut text = table(&headers, &rows);
    for column in ["ACTIVE", "PID"] {
        if text.lines().all(|l| l.chars().count() <= 80) {
            break;
        }
        let Some(at) = headers.iter().position(|h| *h == column) else { continue };
        headers.remove(at);
        for row in &mut rows {
            row.remove(at);
        }
        text = table(&headers, &rows);
    }
    text
}

/// Short names for `ps` and `status`, by device name: `GPU<n>` for the n-th local GPU,
/// `RPC<n>` for the n-th worker device (as llama.cpp numbers them when a runner gets
/// every worker), `Host` for host memory.
fn device_labels(devices: &[(String, String, String, u64, u64, u64)]) -> HashMap<String, String> {
    let (mut gpus, mut rpcs) = (0, 0);
    devices
        .iter()
        .map(|(kind, name, ..)| {
            let label = match kind.as_str() {
                "host" => "Host".to_owned(),
                "rpc" => {
                    rpcs += 1;
                    format!("RPC{}", rpcs - 1)
                }
                _ => {
                    gpus += 1;
                    format!("GPU{}", gpus - 1)
                }
            };
            (name.clone(), label)
        })
        .collect()
}

/// Where a model's memory is, as shares of its size: "RPC0 80%, Host 20%"; "-" when not known.
fn placement(devices: &[ModelDevice], labels: &HashMap<String, String>) -> String {
    let total: u128 = devices.iter().map(|d| u128::from(d.bytes)).sum();
    if total == 0 {
        return "-".to_owned();
    }
    devices
        .iter()
        .map(|d| {
            let label = labels.get(&d.name).map_or(d.name.as_str(), String::as_str);
            // Rounded to the nearest percent; u128 so that no size overflows.
            let percent = (u128::from(d.bytes) * 100 + total / 2) / total;
            format!("{label} {percent}%")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `show`, or with `modelfile` only the model's Modelfile (as `ollama show --modelfile`).
pub async fn show(bus: &Bus, style: Style, name: &str, modelfile: bool) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let path = manager.get_model(name).await.or_bus(bus)?;
    if modelfile {
        let text = bus.model(path).await?.modelfile().await.or_bus(bus)?;
        if style.json {
            return print_json(&serde_json::json!({ "modelfile": text }));
        }
        return print(&text);
    }
    let info = model_info(bus, path).await?;
    if style.json {
        return print_json(&info);
    }
    print(&describe(&info, SystemTime::now()))
}

fn describe(m: &ModelInfo, now: SystemTime) -> String {
    let mut pairs = vec![
        ("Name", m.name.clone()),
        ("Short name", m.short_name.clone()),
        ("Digest", m.digest.clone()),
        ("Size", size(m.size)),
    ];
    for (key, label) in [
        ("format", "Format"),
        ("family", "Family"),
        ("parameter_size", "Parameters"),
        ("quantization_level", "Quantization"),
    ] {
        if let Some(value) = m.details.get(key).filter(|v| !v.is_empty()) {
            pairs.push((label, value.clone()));
        }
    }
    if m.context_length != 0 {
        pairs.push(("Context length", m.context_length.to_string()));
    }
    if !m.capabilities.is_empty() {
        pairs.push(("Capabilities", m.capabilities.join(", ")));
    }
    if let Some(modified) = &m.modified_at {
        pairs.push(("Modified", modified.clone()));
    }
    if !m.system.is_empty() {
        pairs.push(("System", m.system.clone()));
    }
    if !m.parameters.is_empty() {
        // "Parameters" is the size, as `ollama show` says it; these are the options.
        pairs.push(("Options", m.parameters.trim_end().to_owned()));
    }
    pairs.push(("State", m.state.clone()));
    if !m.last_error.is_empty() {
        pairs.push(("Last error", m.last_error.clone()));
    }
    if m.pid != 0 {
        pairs.push(("Pid", m.pid.to_string()));
        if !m.shared_with.is_empty() {
            pairs.push(("Shares its runner with", m.shared_with.join(", ")));
        }
        let on_cpu = if m.gpu_layers == 0 { " (all on the CPU)" } else { "" };
        pairs.push(("GPU layers", format!("{} of {}{on_cpu}", m.gpu_layers, m.total_layers)));
        pairs.push(("VRAM", size(m.vram_bytes)));
        pairs.push(("RAM", size(m.ram_bytes)));
        let memory: Vec<String> = m
            .memory
            .iter()
            .filter(|d| d.planned > 0 || d.actual > 0)
            .map(|d| format!("{} {} planned, {} actual", d.device, size(d.planned), size(d.actual)))
            .collect();
        if !memory.is_empty() {
            pairs.push(("Memory", memory.join("; ")));
        }
        pairs.push(("Active requests", m.active_requests.to_string()));
        pairs.push(("Unloads", expires(m.expires_micros, now)));
    }
    fields(&pairs)
}

/// `load`.
pub async fn load(bus: &Bus, style: Style, args: &LoadArgs) -> Result<(), CtlError> {
    let mut options: HashMap<&str, Value<'_>> = HashMap::new();
    if let Some(keep_alive) = &args.keep_alive {
        options.insert("keep_alive", Value::from(keep_alive.as_str()));
    }
    if let Some(num_ctx) = args.num_ctx {
        options.insert("num_ctx", Value::from(num_ctx));
    }
    if let Some(num_gpu) = args.num_gpu {
        options.insert("num_gpu", Value::from(num_gpu));
    }
    let manager = bus.manager().await?;
    let path = manager.load(&args.model, options).await.or_bus(bus)?;
    let info = model_info(bus, path).await?;
    if style.json {
        return print_json(&info);
    }
    let shared = if info.shared_with.is_empty() {
        String::new()
    } else {
        format!(", sharing the runner of {}", quoted(&info.shared_with))
    };
    print(&format!("'{}' is {} (pid {}{shared})\n", info.short_name, info.state, info.pid))
}

/// Names in the one style corralctl and corrald use: 'a', 'b'.
fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

/// `unload`. A stored model that is not loaded is already where unloading takes it:
/// said, and not a failure (as `systemctl stop` on a stopped unit); an unknown model is.
pub async fn unload(bus: &Bus, style: Style, name: &str) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    // Who shares its runner stops with it: read before, to say so.
    let shared = match manager.get_model(name).await {
        Ok(path) => bus.model(path).await?.shared_with().await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let unloaded = match manager.unload(name).await {
        Ok(()) => true,
        Err(e) => match bus.error(e) {
            CtlError::Daemon { name: error, .. } if error == "NotLoaded" => false,
            other => return Err(other),
        },
    };
    if style.json {
        return print_json(&serde_json::json!({ "model": name, "unloaded": unloaded, "also_unloaded": shared }));
    }
    if !unloaded {
        return print(&format!("'{name}' is not loaded: nothing to unload\n"));
    }
    if shared.is_empty() {
        print(&format!("unloaded '{name}'\n"))
    } else {
        print(&format!("unloaded '{name}' and {}, which shared its runner\n", quoted(&shared)))
    }
}

/// `pull` or `push`.
pub async fn transfer(bus: &Bus, style: Style, push: bool, args: &TransferArgs) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let mut options: HashMap<&str, Value<'_>> = HashMap::new();
    if args.insecure {
        options.insert("insecure", Value::from(true));
    }
    let mut watch = Watch::start(bus).await?;
    let path = if push { manager.push(&args.model, options).await } else { manager.pull(&args.model, options).await }
        .or_bus(bus)?;
    finish(watch.follow(bus, path, style.progress(true)).await?, style)
}

/// `create`: the Modelfile's local files passed open over D-Bus (`CreateWithFiles`: read
/// once by corrald, hashed as it copies them); where corrald cannot take them (an older
/// corrald, a bus without descriptor passing), uploaded as blobs over the HTTP API at `api`
/// as Ollama's client does, else named by path.
pub async fn create(
    bus: &Bus,
    style: Style,
    name: &str,
    file: &Path,
    home: Option<&Path>,
    api: &Api,
) -> Result<(), CtlError> {
    let text = std::fs::read_to_string(file)
        .map_err(|source| CtlError::Io { what: format!("cannot read {}", file.display()), source })?;
    let file = std::path::absolute(file)
        .map_err(|source| CtlError::Io { what: format!("cannot resolve {}", file.display()), source })?;
    let dir = file.parent().unwrap_or(Path::new("/"));
    let prepared = modelfile::prepare(&text, dir, home)?;
    // A name corrald would refuse is refused before anything is read or uploaded.
    crate::store::name::ModelName::parse(name).map_err(|e| CtlError::Invalid(e.to_string()))?;
    if !style.json {
        print("gathering model components\n")?;
    }
    let manager = bus.manager().await?;
    if !prepared.files.is_empty() {
        let opened = modelfile::open(&prepared.files)?;
        let files = opened.iter().map(|(key, file)| (key.as_str(), Fd::from(file))).collect();
        let mut watch = Watch::start(bus).await?;
        match manager.create_with_files(name, &prepared.text(&HashMap::new())?, files).await {
            Ok(path) => return finish(watch.follow(bus, path, style.progress(true)).await?, style),
            Err(e) if modelfile::descriptors_refused(&e) => {}
            Err(e) => return Err(bus.error(e)),
        }
    }
    let names = upload_or_name(&prepared.files, style, api).await?;
    let text = prepared.text(&names)?;
    let mut watch = Watch::start(bus).await?;
    let path = manager.create(name, &text).await.or_bus(bus)?;
    finish(watch.follow(bus, path, style.progress(true)).await?, style)
}

/// The files uploaded as blobs over the HTTP API, each named by its digest; without the
/// API, none (corrald then reads them by path, where it can).
async fn upload_or_name(files: &[PathBuf], style: Style, api: &Api) -> Result<HashMap<PathBuf, String>, CtlError> {
    match modelfile::upload(api, files, style.progress(true)).await {
        Ok(names) => Ok(names),
        Err(e @ (CtlError::HttpUnreachable { .. } | CtlError::HttpDenied { .. })) => {
            let _ = writeln!(
                std::io::stderr(),
                "corralctl: cannot upload the files: {e}; corrald reads them by path instead"
            );
            Ok(HashMap::new())
        }
        Err(e) => Err(e),
    }
}

/// `cp`.
pub async fn copy(bus: &Bus, style: Style, source: &str, destination: &str) -> Result<(), CtlError> {
    let mut watch = Watch::start(bus).await?;
    let path = bus.manager().await?.copy(source, destination).await.or_bus(bus)?;
    let outcome = watch.follow(bus, path, Progress::Quiet).await?.into_result()?;
    if style.json {
        return print_json(&outcome);
    }
    print(&format!("copied '{source}' to '{destination}'\n"))
}

/// `rm`: one model after another, stopping at the first failure.
pub async fn remove(bus: &Bus, style: Style, names: &[String]) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let mut watch = Watch::start(bus).await?;
    let mut outcomes = Vec::new();
    for name in names {
        let path = manager.delete(name).await.or_bus(bus)?;
        let outcome = watch.follow(bus, path, Progress::Quiet).await?.into_result()?;
        if !style.json {
            print(&format!("deleted '{name}'\n"))?;
        }
        outcomes.push(outcome);
    }
    if style.json { print_json(&outcomes) } else { Ok(()) }
}

fn finish(outcome: Outcome, style: Style) -> Result<(), CtlError> {
    let outcome = outcome.into_result()?;
    if style.json { print_json(&outcome) } else { Ok(()) }
}

/// `status`.
pub async fn status(bus: &Bus, style: Style) -> Result<(), CtlError> {
    let m = bus.manager().await?;
    let listed = m.devices().await.or_bus(bus)?;
    let labels = device_labels(&listed);
    let status = Status {
        version: m.version().await.or_bus(bus)?,
        gpus: m
            .gpus()
            .await
            .or_bus(bus)?
            .into_iter()
            .map(|(id, name, driver, total_bytes, usable_bytes)| GpuInfo {
                id,
                name,
                driver,
                total_bytes,
                usable_bytes,
            })
            .collect(),
        devices: listed
            .into_iter()
            .map(|(kind, name, description, total_bytes, usable_bytes, used_bytes)| DeviceInfo {
                kind,
                name,
                description,
                total_bytes,
                usable_bytes,
                used_bytes,
            })
            .collect(),
        workers: m
            .workers()
            .await
            .or_bus(bus)?
            .into_iter()
            .map(|(name, address, state, devices, last_error, rtt_usec, _)| WorkerInfo {
                name,
                address,
                state,
                devices,
                last_error,
                rtt_usec,
            })
            .collect(),
        host_memory: m.host_memory().await.or_bus(bus)?,
        loaded_models: m.loaded_models().await.or_bus(bus)?,
        queue_depth: m.queue_depth().await.or_bus(bus)?,
        max_loaded_models: m.max_loaded_models().await.or_bus(bus)?,
        max_queue: m.max_queue().await.or_bus(bus)?,
        default_keep_alive: m.default_keep_alive().await.or_bus(bus)?,
    };
    if style.json {
        return print_json(&status);
    }
    let loaded = if status.loaded_models.is_empty() { "none".to_owned() } else { status.loaded_models.join(", ") };
    let mut shown = vec![("Version", status.version.clone()), ("Devices", devices_text(&status.devices, &labels))];
    if !status.workers.is_empty() {
        shown.push(("Workers", workers_text(&status.workers)));
    }
    shown.extend([
        // Names of one model share a runner, and the limit counts runners: no "N of M" here.
        ("Loaded models", format!("{loaded} (at most {} runners)", status.max_loaded_models)),
        ("Queue depth", format!("{} of at most {}", status.queue_depth, status.max_queue)),
        ("Keep-alive", output::keep_alive(status.default_keep_alive)),
    ]);
    print(&fields(&shown))
}

/// One line per worker: "w1 (10.0.0.2:50052): up, 1 device, 0.3 ms" or
/// "w2 (10.0.0.3:50052): down: cannot connect …".
fn workers_text(workers: &[WorkerInfo]) -> String {
    workers
        .iter()
        .map(|w| {
            if w.state == "up" {
                let rtt = std::time::Duration::from_micros(w.rtt_usec);
                format!(
                    "{} ({}): up, {}, {}",
                    w.name,
                    w.address,
                    crate::units::count(w.devices.len(), "device", "devices"),
                    crate::durations::human(rtt)
                )
            } else {
                format!("{} ({}): {}: {}", w.name, w.address, w.state, w.last_error)
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// One line per device: "RPC0  w1 (rpc:h:1#0):  12 MiB used, 200 MiB usable of 200 MiB".
fn devices_text(devices: &[DeviceInfo], labels: &HashMap<String, String>) -> String {
    let rows: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let named =
                if d.kind == "host" { d.description.clone() } else { format!("{} ({})", d.description, d.name) };
            vec![
                labels.get(&d.name).cloned().unwrap_or_else(|| d.kind.clone()),
                format!("{named}:"),
                format!("{} used, {} usable of {}", size(d.used_bytes), size(d.usable_bytes), size(d.total_bytes)),
            ]
        })
        .collect();
    // The table's header is not wanted here: it is the first line.
    table(&["", "", ""], &rows).lines().skip(1).collect::<Vec<_>>().join("\n")
}

/// `list --quiet`: the names only, one a line, sorted (shell completion reads them).
pub async fn names(bus: &Bus) -> Result<(), CtlError> {
    let manager = bus.manager().await?;
    let mut names: Vec<String> = manager.list_models().await.or_bus(bus)?.into_iter().map(|(name, ..)| name).collect();
    names.sort();
    names.dedup();
    let mut text = names.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    print(&text)
}

#[cfg(test)]
mod tests {
    use super::{ModelDevice, WorkerInfo, device_labels, narrow, placement, workers_text};

    #[test]
    fn workers_read_as_up_with_their_devices_or_down_with_why() {
        let worker = |name: &str, state: &str, devices: usize, error: &str| WorkerInfo {
            name: name.into(),
            address: format!("10.0.0.{}:50052", devices + 2),
            state: state.into(),
            devices: vec!["rpc:x#0".into(); devices],
            last_error: error.into(),
            rtt_usec: 1500,
        };
        assert_eq!(
            workers_text(&[worker("a", "up", 1, ""), worker("b", "down", 0, "cannot connect: refused")]),
            "a (10.0.0.3:50052): up, 1 device, 1 ms\nb (10.0.0.2:50052): down: cannot connect: refused"
        );
    }

    #[test]
    fn devices_get_short_labels_and_placements_read_as_shares() {
        let row = |kind: &str, name: &str| (kind.to_owned(), name.to_owned(), String::new(), 0, 0, 0);
        let labels = device_labels(&[
            row("cuda", "GPU-a"),
            row("rpc", "rpc:h:1#0"),
            row("rpc", "rpc:h:2#0"),
            row("vulkan", "v"),
            row("host", "host"),
        ]);
        let label = |name: &str| labels[name].as_str();
        assert_eq!(
            [label("GPU-a"), label("rpc:h:1#0"), label("rpc:h:2#0"), label("v"), label("host")],
            ["GPU0", "RPC0", "RPC1", "GPU1", "Host"]
        );
        let share = |name: &str, bytes| ModelDevice { name: name.into(), kind: String::new(), bytes };
        assert_eq!(placement(&[share("rpc:h:1#0", 80), share("host", 20)], &labels), "RPC0 80%, Host 20%");
        assert_eq!(placement(&[share("unknown", 5)], &labels), "unknown 100%");
        assert_eq!(placement(&[], &labels), "-");
        assert_eq!(placement(&[share("host", u64::MAX), share("v", u64::MAX)], &labels), "Host 50%, GPU1 50%");
    }

    #[test]
    fn wide_tables_drop_active_then_pid() {
        let rows = |name: &str| vec![vec![name.to_owned(), "1".to_owned(), "2".to_owned()]];
        assert_eq!(narrow(&["NAME", "PID", "ACTIVE"], rows("short")), "NAME   PID  ACTIVE\nshort  1    2\n");
        let long = "x".repeat(75);
        assert_eq!(
            narrow(&["NAME", "PID", "ACTIVE"], rows(&long)),
            format!("NAME{}  PID\n{long}  1\n", " ".repeat(71))
        );
        let longer = "x".repeat(79);
        assert_eq!(narrow(&["NAME", "PID", "ACTIVE"], rows(&longer)), format!("NAME\n{longer}\n"));
    }
}
