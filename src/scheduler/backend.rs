//! What the scheduler starts and stops: runners, behind a trait so that scheduling is
//! tested without processes ([`Backend`]), and the real one on the supervisor.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::policy::{Footprint, Placement};
use crate::gpu::MemoryProbe;
use crate::supervisor::command::{self, LoadOptions, ModelFiles};
use crate::supervisor::logparse::Offload;
use crate::supervisor::runner::{self, Runner, RunnerSpec, SupervisorConfig};

/// A boxed future, as trait objects return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the scheduler asks a backend to start.
#[derive(Debug, Clone)]
pub struct StartRequest {
    /// The runner's id.
    pub id: u64,
    /// The model's display name.
    pub model: String,
    /// Its files.
    pub files: ModelFiles,
    /// Load options.
    pub options: LoadOptions,
    /// Where the scheduler placed it.
    pub placement: Placement,
}

/// A started runner.
pub trait LiveRunner: Send + 'static {
    /// The UNIX socket it serves on.
    fn socket(&self) -> PathBuf;
    /// What it really uses, as measured after the load.
    fn measured(&self) -> Option<Footprint>;
    /// The child's process id, for reports.
    fn pid(&self) -> u32;
    /// The layers it placed on GPUs, when it said.
    fn offload(&self) -> Option<Offload> {
        None
    }
    /// Stops it; resolves once it is reaped.
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()>;
    /// Resolves (with a reason) if it dies on its own.
    fn exited(&mut self) -> BoxFuture<'_, String>;
}

/// Starts runners.
pub trait Backend: Send + Sync + 'static {
    /// Starts one; resolves once it is ready, or with why it could not start.
    fn start(&self, request: StartRequest) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, String>>;
}

/// The real backend: llama-server children through the supervisor.
#[derive(Debug, Clone)]
pub struct SupervisorBackend {
    /// The supervisor's configuration.
    pub config: SupervisorConfig,
    /// The load timeout (restarted by progress).
    pub load_timeout: Duration,
    /// The ids the GPUs of the inventory are known by, by index, for device visibility.
    pub devices: Vec<command::Device>,
    /// Per-process GPU memory (NVML), where the probe can tell.
    pub probe: Option<Arc<dyn MemoryProbe>>,
}

impl std::fmt::Debug for dyn MemoryProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("memory probe")
    }
}

impl Backend for SupervisorBackend {
    fn start(&self, request: StartRequest) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, String>> {
        let config = self.config.clone();
        let devices = match &request.placement {
            Placement::Gpu(index) => self.devices.get(*index).cloned().into_iter().collect(),
            Placement::Spread(shares) => {
                shares.iter().filter_map(|(index, _)| self.devices.get(*index).cloned()).collect()
            }
            Placement::Cpu => Vec::new(),
        };
        let mut options = request.options.clone();
        if request.placement == Placement::Cpu && !self.devices.is_empty() {
            // Placed on the CPU although GPUs exist: keep the weights off them.
            options.num_gpu = Some(0);
        }
        let spec = RunnerSpec {
            id: request.id,
            model: request.model.clone(),
            files: request.files.clone(),
            options,
            placement: command::Placement { devices, ..command::Placement::default() },
            load_timeout: self.load_timeout,
            memory_max: None,
        };
        let probe = self.probe.clone();
        Box::pin(async move {
            let runner = runner::load(&config, &spec).await.map_err(|e| e.to_string())?;
            Ok(Box::new(SupervisedRunner { runner, probe }) as Box<dyn LiveRunner>)
        })
    }
}

struct SupervisedRunner {
    runner: Runner,
    probe: Option<Arc<dyn MemoryProbe>>,
}

impl LiveRunner for SupervisedRunner {
    fn socket(&self) -> PathBuf {
        self.runner.socket().to_owned()
    }

    /// The larger of each source: parsed buffer sizes, the process's GPU memory as NVML
    /// sees it, and the cgroup's peak for host memory.
    fn measured(&self) -> Option<Footprint> {
        let report = self.runner.report();
        let peak = self.runner.memory().and_then(|m| m.peak.or(Some(m.current))).unwrap_or(0);
        let nvml = self.probe.as_ref().and_then(|p| p.process_vram(self.pid())).unwrap_or(0);
        let vram = report.vram_bytes().max(nvml);
        let ram = report.ram_bytes().max(peak.saturating_sub(vram));
        (vram + ram > 0).then_some(Footprint { vram, ram })
    }

    fn pid(&self) -> u32 {
        self.runner.pid().as_raw().unsigned_abs()
    }

    fn offload(&self) -> Option<Offload> {
        self.runner.report().offload()
    }

    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.runner.stop().await;
        })
    }

    fn exited(&mut self) -> BoxFuture<'_, String> {
        Box::pin(async move { self.runner.exited().await.to_string() })
    }
}
