//! One llama-server child from spawn to reap.
//!
//! [`load`] spawns the child in its own cgroup (or process group), forwards and parses
//! every line it prints, and returns once the child printed its `listening` line, its
//! task loop runs (`all slots are idle`; until then llama-server loses a SIGTERM), and it
//! answered one `/health` with 200; a load that stops making progress (no output for
//! `load_timeout`) or a child that exits first is a [`LoadError`] naming the cause.
//! A [`Runner`] is then owned by whoever loaded it: [`Runner::stop`] returns once the
//! child is reaped, [`Runner::exited`] resolves if it dies on its own.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::cgroup::{CgroupTree, MemoryUsage, RunnerCgroup};
use super::child_log::{ChildLog, LogSink, Milestone};
use super::command::{self, Invocation, LoadOptions, ModelFiles, Placement, PlannedDevice};
use super::logparse::{ErrorClass, LoadReport};
use super::upstream;
use super::worker_links;

/// What every runner shares: the executable, directories, environment and containment.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The llama-server executable.
    pub llama_server: PathBuf,
    /// Where runner sockets go (`/run/corral`).
    pub runtime_dir: PathBuf,
    /// The daemon's environment; only `command::INHERITED_VARIABLES` reach a child.
    pub inherited_env: Vec<(OsString, OsString)>,
    /// Where child output goes.
    pub log_sink: LogSink,
    /// The delegated cgroup tree, or `None` for process groups only.
    pub cgroups: Option<CgroupTree>,
    /// How long a child may take to exit after SIGTERM before it is killed.
    pub stop_grace: Duration,
    /// How long a child's connection to an RPC worker may go unanswered before the
    /// kernel drops it (`[worker_health] timeout`; see [`super::worker_links`]).
    pub worker_link_timeout: Duration,
}

/// What to load.
#[derive(Debug, Clone)]
pub struct RunnerSpec {
    /// A number unique in this daemon's lifetime: names the socket and the cgroup.
    pub id: u64,
    /// The model's name, for logs and the child's `/v1/models`.
    pub model: String,
    /// The model's files.
    pub files: ModelFiles,
    /// Load options.
    pub options: LoadOptions,
    /// Placement.
    pub placement: Placement,
    /// The load fails when the child prints nothing for this long.
    pub load_timeout: Duration,
    /// A memory limit for the runner's cgroup.
    pub memory_max: Option<u64>,
    /// The bytes the plan expects on each device, by llama.cpp's device names, the host
    /// as [`HOST`]; reported next to what the child really took.
    pub planned: Vec<(String, u64)>,
}

/// The name the host's memory goes by in plans and reports (as `llama-fit-params` prints it).
pub const HOST: &str = "Host";

/// One device's memory for a runner: planned before the load, and what llama.cpp
/// reported allocating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device as llama.cpp names it (`CUDA0`, `RPC1`), or [`HOST`].
    pub device: String,
    /// What the plan expected, when there was a plan for it.
    pub planned: Option<u64>,
    /// What the child's buffers took there.
    pub actual: u64,
}

/// Each device of the plan, and each other device the child used, with both figures; the
/// host last. `buffers` maps planned device names to their buffers' names in the log.
#[must_use]
pub fn device_memory(planned: &[(String, u64)], buffers: &[PlannedDevice], report: &LoadReport) -> Vec<DeviceMemory> {
    let buffer_of = |device: &str| {
        buffers.iter().find(|b| b.name == device).map_or_else(|| device.to_owned(), |b| b.buffer.clone())
    };
    let mut devices: Vec<(String, String)> =
        planned.iter().filter(|(name, _)| name != HOST).map(|(name, _)| (name.clone(), buffer_of(name))).collect();
    for buffer in report.devices() {
        if !devices.iter().any(|(_, b)| *b == buffer) {
            devices.push((buffer.clone(), buffer));
        }
    }
    let mut memory: Vec<DeviceMemory> = devices
        .into_iter()
        .map(|(device, buffer)| {
            let planned = planned.iter().find(|(name, _)| *name == device).map(|(_, bytes)| *bytes);
            DeviceMemory { actual: report.device_bytes(&buffer), device, planned }
        })
        .collect();
    let host = planned.iter().find(|(name, _)| name == HOST).map(|(_, bytes)| *bytes);
    memory.push(DeviceMemory { device: HOST.to_owned(), planned: host, actual: report.ram_bytes() });
    memory
}

/// Why a child ended or failed to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The model file is missing, corrupt or unsupported by this llama-server.
    BadModelFile,
    /// Not enough memory (reported by llama.cpp).
    OutOfMemory,
    /// The socket could not be bound.
    BindFailure,
    /// llama-server rejected its command line.
    InvalidArgument,
    /// Killed by a signal it did not ask for (the kernel's OOM killer sends SIGKILL).
    Killed,
    /// Exited with an error and no line that says why.
    Crashed,
}

impl Failure {
    fn from_exit(class: Option<ErrorClass>, status: ExitStatus) -> Self {
        match class {
            Some(ErrorClass::BadModelFile) => Self::BadModelFile,
            Some(ErrorClass::OutOfMemory) => Self::OutOfMemory,
            Some(ErrorClass::BindFailure) => Self::BindFailure,
            Some(ErrorClass::InvalidArgument) => Self::InvalidArgument,
            Some(ErrorClass::Other) | None if status.signal().is_some() => Self::Killed,
            // llama.cpp aborts (SIGABRT) when an RPC worker goes: a crash, not a kill.
            Some(ErrorClass::WorkerLost | ErrorClass::Other) | None => Self::Crashed,
        }
    }

    /// A short name for logs, events and API errors.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadModelFile => "bad model file",
            Self::OutOfMemory => "out of memory",
            Self::BindFailure => "bind failure",
            Self::InvalidArgument => "invalid argument",
            Self::Killed => "killed",
            Self::Crashed => "crashed",
        }
    }
}

/// How a child ended.
#[derive(Debug, Clone)]
pub struct Exit {
    /// Its wait status.
    pub status: ExitStatus,
    /// True when corral stopped it.
    pub requested: bool,
    /// Why, when it was not a requested stop or a clean exit.
    pub failure: Option<Failure>,
    /// Its last error lines, oldest first.
    pub last_errors: Vec<String>,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "llama-server {}", self.status)?;
        if let Some(failure) = self.failure {
            write!(f, " ({})", failure.as_str())?;
        }
        if let Some(last) = self.last_errors.last() {
            write!(f, ": {last}")?;
        }
        Ok(())
    }
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The process could not be started.  The message names the key that sets the
    /// program, and the program (a path, which client-facing copies shorten).
    #[error(
        "cannot start llama-server ([runner] llama_server = {program}{}): {source}",
        if program.contains('/') { "" } else { ", looked up on PATH" }
    )]
    Spawn {
        /// The executable.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The runner's cgroup could not be set up.
    #[error("cannot set up the runner's cgroup: {0}")]
    Cgroup(std::io::Error),
    /// The child exited before it was ready.
    #[error("{0}")]
    Exited(Exit),
    /// The child printed nothing for the load timeout.
    #[error("llama-server made no progress for {} while loading{}", crate::durations::human(*after), last.as_ref().map(|l| format!(": {l}")).unwrap_or_default())]
    Stalled {
        /// The timeout.
        after: Duration,
        /// Its last error line, if any.
        last: Option<String>,
    },
    /// It said it was listening, but `/health` did not answer 200.
    #[error("llama-server is listening but unhealthy: {0}")]
    Unhealthy(String),
}

impl LoadError {
    /// The failure class, when the child ended.
    #[must_use]
    pub fn failure(&self) -> Option<Failure> {
        match self {
            Self::Exited(exit) => exit.failure,
            _ => None,
        }
    }
}

/// A ready llama-server.
#[derive(Debug)]
pub struct Runner {
    id: u64,
    pid: Pid,
    socket: PathBuf,
    report: LoadReport,
    load_time: Duration,
    projector_on_cpu: bool,
    stop: Option<oneshot::Sender<Duration>>,
    exit: watch::Receiver<Option<Exit>>,
    task: Option<JoinHandle<()>>,
    cgroup: Option<Arc<RunnerCgroup>>,
    stop_grace: Duration,
}

impl Runner {
    /// The runner's id.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The child's process id.
    #[must_use]
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// The UNIX socket the child serves HTTP on.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the load reported: offload, buffers.
    #[must_use]
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// From spawn to healthy.
    #[must_use]
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// True when the projector ended up on the CPU after an out-of-memory retry.
    #[must_use]
    pub fn projector_on_cpu(&self) -> bool {
        self.projector_on_cpu
    }

    /// Memory use from the runner's cgroup, where there is one with the memory controller.
    #[must_use]
    pub fn memory(&self) -> Option<MemoryUsage> {
        self.cgroup.as_ref().and_then(|c| c.memory())
    }

    /// Resolves when the child exits without being asked to.
    pub async fn exited(&mut self) -> Exit {
        loop {
            if let Some(exit) = self.exit.borrow_and_update().clone() {
                return exit;
            }
            if self.exit.changed().await.is_err() {
                return self.exit.borrow().clone().unwrap_or_else(unreachable_exit);
            }
        }
    }

    /// Kills the child (SIGKILL, no grace period): for one that cannot finish anything,
    /// its worker gone; returns once it is reaped and its cgroup removed.
    pub async fn kill(mut self) -> Exit {
        self.stop_grace = Duration::ZERO;
        self.stop().await
    }

    /// Stops the child: SIGTERM, up to the grace period, then SIGKILL; returns once it is
    /// reaped and its cgroup removed. Close connections to the runner first: llama-server
    /// waits for open requests before it exits.
    pub async fn stop(mut self) -> Exit {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(self.stop_grace);
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.exit.borrow().clone().unwrap_or_else(unreachable_exit)
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // A runner dropped without stop(): the child must not outlive it.
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Duration::ZERO);
        }
    }
}

fn unreachable_exit() -> Exit {
    // The child task always publishes an exit before it ends; this covers a panic in it.
    Exit { status: ExitStatus::from_raw(0), requested: false, failure: Some(Failure::Crashed), last_errors: Vec::new() }
}

/// Loads a model: spawns llama-server and returns once it is ready.
///
/// When the load runs out of memory with the projector on a GPU, it is retried once
/// with the projector on the CPU.
pub async fn load(config: &SupervisorConfig, spec: &RunnerSpec) -> Result<Runner, LoadError> {
    match load_once(config, spec, &spec.placement).await {
        Err(e)
            if e.failure() == Some(Failure::OutOfMemory)
                && spec.files.projector.is_some()
                && !spec.placement.projector_on_cpu =>
        {
            tracing::warn!(
                corral_event = "load-retry",
                corral_model = %spec.model,
                error = %e,
                "{}: out of memory with the projector on the GPU; retrying with the projector on the CPU",
                spec.model
            );
            let placement = Placement { projector_on_cpu: true, ..spec.placement.clone() };
            load_once(config, spec, &placement).await
        }
        other => other,
    }
}

async fn load_once(config: &SupervisorConfig, spec: &RunnerSpec, placement: &Placement) -> Result<Runner, LoadError> {
    let started = Instant::now();
    let socket = config.runtime_dir.join(format!("runner-{}.sock", spec.id));
    // llama-server serves HTTP on a UNIX socket when --host ends in ".sock"; a stale file would make it fail.
    let _ = std::fs::remove_file(&socket);
    let invocation = command::invocation(&command::Request {
        program: &config.llama_server,
        files: &spec.files,
        options: &spec.options,
        placement,
        socket: &socket,
        alias: &spec.model,
        inherited_env: &config.inherited_env,
    });
    let cgroup = match &config.cgroups {
        Some(tree) => Some(Arc::new(tree.create_runner(spec.id, spec.memory_max).map_err(LoadError::Cgroup)?)),
        None => None,
    };
    let spawn_error = |source| {
        if let Some(cgroup) = &cgroup {
            let _ = cgroup.remove();
        }
        LoadError::Spawn { program: invocation.program.display().to_string(), source }
    };
    let (stderr, stderr_writer) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| spawn_error(std::io::Error::from(e)))?;
    let child = spawn(&invocation, cgroup.as_deref(), stderr_writer).map_err(spawn_error)?;
    let pid = Pid::from_raw(child.id().and_then(|id| i32::try_from(id).ok()).unwrap_or_default());

    let (ready_tx, mut ready_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = oneshot::channel();
    let (exit_tx, exit_rx) = watch::channel(None);
    let (progress_tx, mut progress_rx) = watch::channel(Instant::now());
    let log = match ChildLog::start(stderr.into(), config.log_sink.clone(), spec.model.clone(), pid, progress_tx) {
        Ok(log) => log,
        Err(e) => {
            // Without its reader the child would block on a full pipe: it goes at once.
            let _ = killpg(pid, Signal::SIGKILL);
            return Err(spawn_error(e));
        }
    };
    let watcher = ChildWatcher {
        model: spec.model.clone(),
        planned: spec.planned.clone(),
        buffers: spec.placement.plan.clone().map(|p| p.devices).unwrap_or_default(),
        pid,
        socket: socket.clone(),
        cgroup: cgroup.clone(),
    };
    let task = tokio::spawn(watcher.run(child, log, ready_tx, stop_rx, exit_tx));
    let mut runner = Runner {
        id: spec.id,
        pid,
        socket,
        report: LoadReport::new(),
        load_time: Duration::ZERO,
        projector_on_cpu: placement.projector_on_cpu,
        stop: Some(stop_tx),
        exit: exit_rx,
        task: Some(task),
        cgroup,
        stop_grace: config.stop_grace,
    };

    // The timeout restarts whenever the child prints something: a slow load that makes
    // progress is not a stalled one.
    let outcome = loop {
        let deadline = *progress_rx.borrow_and_update() + spec.load_timeout;
        tokio::select! {
            ready = &mut ready_rx => break ready.unwrap_or(Err(ReadyError::Gone)),
            _ = progress_rx.changed() => {}
            () = tokio::time::sleep_until(deadline.into()) => {
                if *progress_rx.borrow() + spec.load_timeout <= Instant::now() {
                    break Err(ReadyError::Stalled);
                }
            }
        }
    };
    match outcome {
        Ok(report) => {
            if !placement.rpc_servers.is_empty() {
                watch_worker_links(pid, &spec.model, config.worker_link_timeout);
            }
            runner.report = report;
            runner.load_time = started.elapsed();
            Ok(runner)
        }
        Err(ReadyError::Unhealthy(why)) => {
            runner.stop().await;
            Err(LoadError::Unhealthy(why))
        }
        Err(ReadyError::Stalled) => {
            runner.stop_grace = Duration::ZERO;
            let exit = runner.stop().await;
            Err(LoadError::Stalled { after: spec.load_timeout, last: exit.last_errors.last().cloned() })
        }
        Err(ReadyError::Gone) => {
            let exit = runner.stop().await;
            Err(LoadError::Exited(exit))
        }
    }
}

/// Makes a ready runner's worker connections fail when a worker stops answering; without
/// it (the kernel or a system call filter refuses) a worker cut off while the runner waits
/// for its answer is noticed only when the runner next sends to it.
fn watch_worker_links(pid: Pid, model: &str, timeout: Duration) {
    match worker_links::arm(Path::new("/proc"), pid, timeout) {
        Ok(armed) => tracing::debug!(corral_model = %model, armed, "keepalive set on the runner's worker connections"),
        Err(e) => tracing::warn!(
            corral_model = %model,
            error = %e,
            "{model}: cannot set keepalive on the runner's worker connections: a worker cut off while it computes may go unnoticed"
        ),
    }
}

/// Spawns the child: clean environment, own process group, a parent-death signal, and
/// (with cgroups) moved into its cgroup before it runs any code of its own.
#[allow(unsafe_code)]
fn spawn(
    invocation: &Invocation,
    cgroup: Option<&RunnerCgroup>,
    stderr: std::os::fd::OwnedFd,
) -> std::io::Result<Child> {
    let procs = cgroup.map(RunnerCgroup::procs_file).transpose()?;
    let parent = nix::unistd::getpid();
    let mut cmd = Command::new(&invocation.program);
    cmd.args(&invocation.args)
        .env_clear()
        .envs(invocation.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec, so it must only make
    // async-signal-safe calls: prctl, getppid, write and _exit are raw system calls here,
    // and nothing allocates or takes a lock.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The parent may have died between fork and prctl: then no signal would come.
            if nix::unistd::getppid() != parent {
                libc::_exit(1);
            }
            if let Some(procs) = &procs {
                // "0" moves the writing process, this child, into the runner's cgroup.
                nix::unistd::write(procs, b"0")?;
            }
            Ok(())
        });
    }
    cmd.spawn()
}

enum ReadyError {
    Unhealthy(String),
    Stalled,
    Gone,
}

/// The task that owns one child: tells the loader when it is ready, stops it on
/// request, and publishes how it ended. Its output is read by a [`ChildLog`].
struct ChildWatcher {
    model: String,
    planned: Vec<(String, u64)>,
    buffers: Vec<PlannedDevice>,
    pid: Pid,
    socket: PathBuf,
    cgroup: Option<Arc<RunnerCgroup>>,
}

impl ChildWatcher {
    async fn run(
        self,
        mut child: Child,
        mut log: ChildLog,
        ready: oneshot::Sender<Result<LoadReport, ReadyError>>,
        mut stop: oneshot::Receiver<Duration>,
        exit: watch::Sender<Option<Exit>>,
    ) {
        let mut ready = Some(ready);
        let mut requested = None;
        let mut listening_since: Option<Instant> = None;
        let status = loop {
            tokio::select! {
                Some(milestone) = log.milestone(), if ready.is_some() => match milestone {
                    Milestone::Listening => listening_since = Some(Instant::now()),
                    // Ready once its task loop runs too: a SIGTERM before that is lost upstream.
                    Milestone::TaskLoop => self.ready(&log, &mut ready).await,
                },
                // A build that never prints the idle line is ready a moment after listening.
                () = sleep_until_or_forever(listening_since.filter(|_| ready.is_some()).map(|t| t + IDLE_LINE_WAIT)) => {
                    self.ready(&log, &mut ready).await;
                }
                status = child.wait() => break status,
                grace = &mut stop, if requested.is_none() => {
                    let grace = grace.unwrap_or(Duration::ZERO);
                    requested = Some(grace);
                    break self.terminate(&mut child, grace).await;
                }
            }
        };
        // What the child wrote before it ended, for its last error lines.
        let report = log.finish(Duration::from_millis(200)).await;
        let status = status.unwrap_or_else(|_| ExitStatus::from_raw(0));
        if let Some(cgroup) = &self.cgroup {
            let cgroup = Arc::clone(cgroup);
            let _ = tokio::task::spawn_blocking(move || cgroup.kill_and_remove(Duration::from_secs(5))).await;
        } else {
            // Anything the child started in its process group goes with it.
            let _ = killpg(self.pid, Signal::SIGKILL);
        }
        let _ = std::fs::remove_file(&self.socket);
        let failure = if requested.is_some() || status.success() {
            None
        } else {
            Some(Failure::from_exit(report.failure_class(), status))
        };
        let last_errors = report.errors().map(|e| e.message.clone()).collect();
        let ended = Exit { status, requested: requested.is_some(), failure, last_errors };
        if !ended.requested {
            tracing::warn!(
                corral_event = "crash",
                corral_model = %self.model,
                corral_runner_pid = self.pid.as_raw(),
                "the runner of {} ended: {ended}",
                self.model
            );
        }
        if let Some(ready) = ready.take() {
            let _ = ready.send(Err(ReadyError::Gone));
        }
        let _ = exit.send(Some(ended));
    }

    /// Confirms readiness and tells the loader, once; the log is read in batches from then on.
    async fn ready(&self, log: &ChildLog, ready: &mut Option<oneshot::Sender<Result<LoadReport, ReadyError>>>) {
        let report = log.report().clone();
        let outcome = self.confirm(&report).await;
        log.settle();
        if let Some(ready) = ready.take() {
            let _ = ready.send(outcome);
        }
    }

    /// One `/health` after the listening line: the load is over when it answers 200.
    async fn confirm(&self, report: &LoadReport) -> Result<LoadReport, ReadyError> {
        match upstream::get(&self.socket, "/health", Duration::from_secs(10)).await {
            Ok((status, _)) if status.is_success() => {
                self.log_offload(report);
                Ok(report.clone())
            }
            Ok((status, body)) => Err(ReadyError::Unhealthy(format!("{status}: {}", String::from_utf8_lossy(&body)))),
            Err(e) => Err(ReadyError::Unhealthy(e.to_string())),
        }
    }

    fn log_offload(&self, report: &LoadReport) {
        let (gpu_layers, total_layers) = report.offload().map_or((0, 0), |o| (o.gpu_layers, o.total_layers));
        let devices = device_memory(&self.planned, &self.buffers, report);
        let planned_vram: u64 =
            devices.iter().filter(|d| d.device != HOST).filter_map(|d| d.planned).fold(0, u64::saturating_add);
        let host_planned = devices.iter().find(|d| d.device == HOST).and_then(|d| d.planned);
        // `RPC0:planned=N,actual=M;Host:…` for machines; the message says it for people.
        let fields: Vec<String> = devices
            .iter()
            .map(|d| match d.planned {
                Some(planned) => format!("{}:planned={planned},actual={}", d.device, d.actual),
                None => format!("{}:actual={}", d.device, d.actual),
            })
            .collect();
        let shown: Vec<String> = devices
            .iter()
            .filter(|d| d.planned.is_some() || d.actual > 0)
            .map(|d| match d.planned {
                Some(planned) => format!(
                    "{} {} planned, {} actual",
                    d.device,
                    crate::units::bytes(planned),
                    crate::units::bytes(d.actual)
                ),
                None => format!("{} {}", d.device, crate::units::bytes(d.actual)),
            })
            .collect();
        tracing::info!(
            corral_event = "offload",
            corral_model = %self.model,
            corral_runner_pid = self.pid.as_raw(),
            corral_gpu_layers = gpu_layers,
            corral_total_layers = total_layers,
            corral_vram_bytes = report.vram_bytes(),
            corral_ram_bytes = report.ram_bytes(),
            corral_planned_vram_bytes = planned_vram,
            corral_planned_ram_bytes = host_planned,
            corral_devices = fields.join(";"),
            // What the kernel charged the runner's cgroup, its peak where the kernel has it.
            corral_memory_peak_bytes = self.cgroup.as_ref().and_then(|c| c.memory()).map(|m| m.peak.unwrap_or(m.current)),
            "{}: {gpu_layers} of {total_layers} layers on GPUs, {} of VRAM, {} of RAM ({})",
            self.model,
            crate::units::bytes(report.vram_bytes()),
            crate::units::bytes(report.ram_bytes()),
            shown.join("; "),
        );
    }

    async fn terminate(&self, child: &mut Child, grace: Duration) -> std::io::Result<ExitStatus> {
        let _ = killpg(self.pid, Signal::SIGTERM);
        if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
            return status;
        }
        let _ = killpg(self.pid, Signal::SIGKILL);
        child.wait().await
    }
}

/// How long readiness waits for the idle line after the listening line.
const IDLE_LINE_WAIT: Duration = Duration::from_secs(1);

async fn sleep_until_or_forever(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}
