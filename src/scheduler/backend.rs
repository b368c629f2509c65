//! What the scheduler starts and stops: runners, behind a trait so that scheduling is
//! tested without processes ([`Backend`]), and the real one on the supervisor.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use std::ffi::OsString;

use super::failure::{FailureClass, LoadFailure};
use super::policy::{Footprint, Placement};
use crate::gpu::MemoryProbe;
use crate::supervisor::command::{self, Backend as Family, DevicePlan, LoadOptions, ModelFiles, PlannedDevice};
use crate::supervisor::logparse::Offload;
use crate::supervisor::runner::{self, DeviceMemory, HOST, Runner, RunnerSpec, SupervisorConfig};

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
    /// What the scheduler planned it to use there.
    pub footprint: Footprint,
    /// Each GPU's room (by inventory index) before this load, for the exact plan's check.
    pub rooms: Vec<(usize, u64)>,
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
    /// Each device's memory, planned and actual.
    fn devices(&self) -> Vec<DeviceMemory> {
        Vec::new()
    }
    /// Stops it; resolves once it is reaped.
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()>;
    /// Kills it without a grace period; resolves once it is reaped.
    #[must_use]
    fn kill(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.stop()
    }
    /// Resolves (with a reason) if it dies on its own.
    fn exited(&mut self) -> BoxFuture<'_, String>;
}

/// Starts runners.
pub trait Backend: Send + Sync + 'static {
    /// Starts one; resolves once it is ready, or with why it could not start (classified).
    fn start(&self, request: StartRequest) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, LoadFailure>>;

    /// What a model would take with all its layers on one device (the first of the
    /// inventory; the host when there is none), as llama.cpp projects it, with that
    /// device's compute buffers; `Err` says why no projection can be had (the scheduler
    /// then estimates).
    fn project(&self, files: &ModelFiles, options: &LoadOptions) -> BoxFuture<'static, Result<Projected, String>> {
        let _ = (files, options);
        Box::pin(async { Err("this backend makes no projections".to_owned()) })
    }

    /// The inventory's devices changed (a worker came up with new ones); the indices of
    /// later [`StartRequest`]s refer to `gpus`.
    fn devices_changed(&self, gpus: &[crate::gpu::Gpu]) {
        let _ = gpus;
    }
}

/// A load's memory as llama.cpp projects it with every layer on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Projected {
    /// On the device, and in host memory.
    pub footprint: Footprint,
    /// The device's compute buffers (part of `footprint.vram`): what each device of a
    /// split needs besides its layers.
    pub per_device: u64,
}

/// Which projection is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projecting {
    /// The scheduler's, of a whole model on one device: `llama-fit-params`.
    Planning,
    /// The plan the child of runner `runner` will follow: llama-server's own `--fit` dry
    /// run with the child's arguments, which reserves its compute as the child will.
    Exact {
        /// The runner's id (names the dry run's socket).
        runner: u64,
    },
}

/// llama.cpp's own memory projection of a load.
pub trait Projections: std::fmt::Debug + Send + Sync + 'static {
    /// What a load with these model-shaping arguments and environment takes on each
    /// device (the host as [`HOST`]).
    fn project(
        &self,
        files: &ModelFiles,
        options: &LoadOptions,
        placement: &command::Placement,
        args: Vec<OsString>,
        env: Vec<(OsString, OsString)>,
        projecting: Projecting,
    ) -> BoxFuture<'static, Result<Vec<ProjectedRow>, String>>;
}

/// One device of a projection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectedRow {
    /// The device as llama.cpp names it, or [`HOST`].
    pub name: String,
    /// Everything there.
    pub total: u64,
    /// Its compute buffers (part of `total`).
    pub compute: u64,
}

/// The real backend: llama-server children through the supervisor.
#[derive(Debug, Clone)]
pub struct SupervisorBackend {
    /// The supervisor's configuration.
    pub config: SupervisorConfig,
    /// The load timeout (restarted by progress).
    pub load_timeout: Duration,
    /// The ids the GPUs of the inventory are known by, by index, for device visibility;
    /// written only by the scheduler's task ([`Backend::devices_changed`]).
    pub devices: Arc<std::sync::RwLock<Vec<command::Device>>>,
    /// Per-process GPU memory (NVML), where the probe can tell.
    pub probe: Option<Arc<dyn MemoryProbe>>,
    /// llama.cpp's projections, where `llama-fit-params` is there.
    pub projections: Option<Arc<dyn Projections>>,
}

impl std::fmt::Debug for dyn MemoryProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("memory probe")
    }
}

impl SupervisorBackend {
    /// The devices by inventory index, as the scheduler last said.
    fn devices(&self) -> Vec<command::Device> {
        self.devices.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// How the children know the inventory's devices: a worker's by its address.
    #[must_use]
    pub fn device_ids(gpus: &[crate::gpu::Gpu]) -> Vec<command::Device> {
        gpus.iter()
            .map(|g| command::Device { backend: g.backend, id: g.endpoint.clone().unwrap_or_else(|| g.id.clone()) })
            .collect()
    }
}

impl Backend for SupervisorBackend {
    fn devices_changed(&self, gpus: &[crate::gpu::Gpu]) {
        *self.devices.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Self::device_ids(gpus);
    }

    fn start(&self, request: StartRequest) -> BoxFuture<'static, Result<Box<dyn LiveRunner>, LoadFailure>> {
        let config = self.config.clone();
        let devices = self.devices();
        let placement = child_placement(&devices, &request.placement);
        // Without an exact projection, the plan is the scheduler's own split of the footprint.
        let mut planned: Vec<(String, u64)> = planned_shares(&devices, &placement, &request);
        // Each planned device's room, by llama.cpp's name for it.
        let rooms: Vec<(String, u64)> = request
            .placement
            .devices()
            .iter()
            .zip(placement.plan.iter().flat_map(|p| &p.devices))
            .filter_map(|(index, device)| {
                request.rooms.iter().find(|(i, _)| i == index).map(|(_, room)| (device.name.clone(), *room))
            })
            .collect();
        let projections = self.projections.clone();
        let mut spec = RunnerSpec {
            id: request.id,
            model: request.model.clone(),
            files: request.files.clone(),
            options: request.options.clone(),
            placement,
            load_timeout: self.load_timeout,
            memory_max: None,
            planned: Vec::new(),
        };
        let probe = self.probe.clone();
        Box::pin(async move {
            if let Some(projections) = projections {
                match exact_plan(projections.as_ref(), &config, &mut spec, &rooms).await {
                    Ok(Some(exact)) => planned = exact,
                    Ok(None) => {}
                    // The plan overfills a device by llama.cpp's own count: out of memory, before any allocation.
                    Err(Unfit(why)) => return Err(LoadFailure::new(FailureClass::OutOfMemory, why)),
                }
            }
            spec.planned = planned;
            let runner = runner::load(&config, &spec).await.map_err(LoadFailure::from)?;
            let buffers = spec.placement.plan.map(|p| p.devices).unwrap_or_default();
            Ok(Box::new(SupervisedRunner { runner, probe, planned: spec.planned, buffers }) as Box<dyn LiveRunner>)
        })
    }

    fn project(&self, files: &ModelFiles, options: &LoadOptions) -> BoxFuture<'static, Result<Projected, String>> {
        let Some(projections) = self.projections.clone() else {
            return Box::pin(async { Err(format!("`llama-fit-params` was not found beside {}", "llama-server")) });
        };
        // Every layer on the first local GPU. Not on a worker: an rpc-server serves one
        // client at a time, and may be serving a runner now; with workers alone the CPU
        // stands in (its buffers are the sizes the worker's CPU backend allocates).
        let devices = self.devices();
        let local = devices.iter().position(|d| d.backend != Family::Rpc);
        let whole = local.map_or(Placement::Cpu, Placement::Gpu);
        let placement = child_placement(&devices, &whole);
        let offloads = !devices.is_empty();
        let (args, env) = command::projection(files, options, &placement, &self.config.inherited_env);
        let device = placement.plan.as_ref().and_then(|p| p.devices.first()).map(|d| d.name.clone());
        let projected = projections.project(files, options, &placement, args, env, Projecting::Planning);
        Box::pin(async move {
            let rows = projected.await?;
            let row = |name: &str| rows.iter().find(|r| r.name == name).map_or((0, 0), |r| (r.total, r.compute));
            let (host, _) = row(HOST);
            Ok(match device {
                Some(device) => {
                    let (vram, compute) = row(&device);
                    Projected { footprint: Footprint { vram, ram: host }, per_device: compute }
                }
                // Projected on the CPU for a worker: what the host held goes to the device,
                // and the host keeps compute buffers of its own.
                None if offloads => {
                    let (_, compute) = row(HOST);
                    Projected { footprint: Footprint { vram: host, ram: compute }, per_device: compute }
                }
                None => Projected { footprint: Footprint { vram: 0, ram: host }, per_device: 0 },
            })
        })
    }
}

/// The child's view of a placement: which local GPUs it sees, which workers it reaches,
/// and the devices (by llama.cpp's names) that take its layers.
///
/// llama.cpp names local devices by family and position among the visible ones
/// (`CUDA0`, `ROCm1`, `Vulkan0`) and RPC devices in the order their workers are given to
/// `--rpc`, every device of each worker counted (`RPC0`, `RPC1`, …).
#[must_use]
pub fn child_placement(all: &[command::Device], placement: &Placement) -> command::Placement {
    let (chosen, layers): (Vec<(usize, u64)>, Option<u32>) = match placement {
        Placement::Gpu(index) => (vec![(*index, 1)], None),
        Placement::Spread(shares) => (shares.clone(), None),
        Placement::Partial { shares, layers, .. } => (shares.clone(), Some(*layers)),
        Placement::Cpu => (Vec::new(), None),
    };
    let chosen: Vec<(usize, &command::Device, u64)> =
        chosen.into_iter().filter_map(|(index, bytes)| all.get(index).map(|d| (index, d, bytes))).collect();
    let local: Vec<command::Device> =
        chosen.iter().filter(|(_, d, _)| d.backend != Family::Rpc).map(|(_, d, _)| (*d).clone()).collect();
    let mut rpc_servers: Vec<String> = Vec::new();
    for (_, device, _) in &chosen {
        if device.backend == Family::Rpc && !rpc_servers.contains(&device.id) {
            rpc_servers.push(device.id.clone());
        }
    }
    // (name, buffer name) of a device.
    let names = |index: usize, device: &command::Device| -> (String, String) {
        if device.backend == Family::Rpc {
            // Every device of the workers before this one, then its place among its worker's.
            let before = rpc_servers
                .iter()
                .take_while(|server| **server != device.id)
                .map(|server| all.iter().filter(|d| d.backend == Family::Rpc && d.id == *server).count())
                .sum::<usize>();
            let within = all[..index].iter().filter(|d| d.backend == Family::Rpc && d.id == device.id).count();
            return (format!("RPC{}", before + within), format!("RPC{within}[{}]", device.id));
        }
        let prefix = match device.backend {
            Family::Cuda => "CUDA",
            Family::Rocm => "ROCm",
            Family::Vulkan => "Vulkan",
            Family::Rpc => unreachable!("handled above"),
        };
        let position = local.iter().take_while(|d| *d != device).filter(|d| d.backend == device.backend).count();
        let name = format!("{prefix}{position}");
        (name.clone(), name)
    };
    let devices: Vec<PlannedDevice> = chosen
        .iter()
        .map(|(index, device, bytes)| {
            let (name, buffer) = names(*index, device);
            // -ts takes relative shares: MiB keep the numbers short.
            PlannedDevice { name, buffer, share: (bytes >> 20).max(1) }
        })
        .collect();
    command::Placement {
        devices: local,
        rpc_servers,
        plan: Some(DevicePlan { devices, layers }),
        ..command::Placement::default()
    }
}

/// A plan that llama.cpp's projection says does not fit the devices' room.
struct Unfit(String);

/// llama.cpp's projection of exactly the load `spec` describes, as each device's bytes by
/// name: the plan the child will follow. When a device of a split would take more than
/// its room (a split's compute buffers differ from the one-device projection the
/// scheduler planned with), the split is rebalanced once, in proportion to each device's
/// room over its projected bytes, and projected again. `Ok(None)`: no projection can be
/// had (the scheduler's own plan stands); `Err`: even the rebalanced plan does not fit.
async fn exact_plan(
    projections: &dyn Projections,
    config: &SupervisorConfig,
    spec: &mut RunnerSpec,
    rooms: &[(String, u64)],
) -> Result<Option<Vec<(String, u64)>>, Unfit> {
    let project = |spec: &RunnerSpec| {
        let (args, env) = command::projection(&spec.files, &spec.options, &spec.placement, &config.inherited_env);
        projections.project(
            &spec.files,
            &spec.options,
            &spec.placement,
            args,
            env,
            Projecting::Exact { runner: spec.id },
        )
    };
    let mut rows = match project(spec).await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::debug!(corral_model = %spec.model, "no exact projection for the load: {e}");
            return Ok(None);
        }
    };
    let total = |rows: &[ProjectedRow], name: &str| rows.iter().find(|r| r.name == name).map_or(0, |r| r.total);
    let overfull = |rows: &[ProjectedRow]| {
        rooms.iter().find(|(name, room)| total(rows, name) > *room).map(|(name, room)| (name.clone(), *room))
    };
    if overfull(&rows).is_some() && spec.options.num_gpu.is_none() {
        if let Some(plan) = spec.placement.plan.as_mut().filter(|p| p.devices.len() > 1) {
            for device in &mut plan.devices {
                let room = rooms.iter().find(|(name, _)| *name == device.name).map_or(0, |(_, room)| *room);
                let projected = total(&rows, &device.name).max(1);
                let share = u128::from(device.share) * u128::from(room) / u128::from(projected);
                device.share = u64::try_from(share).unwrap_or(u64::MAX).max(1);
            }
            tracing::info!(corral_model = %spec.model, "rebalancing the split of {} by llama.cpp's projection", spec.model);
            rows = project(spec).await.map_err(|e| Unfit(format!("the rebalanced plan cannot be projected: {e}")))?;
        }
    }
    if let Some((name, room)) = overfull(&rows) {
        return Err(Unfit(format!(
            "llama.cpp projects {} on {name}, which has {} free for it",
            crate::units::bytes(total(&rows, &name)),
            crate::units::bytes(room)
        )));
    }
    Ok(Some(rows.into_iter().map(|r| (r.name, r.total)).collect()))
}

/// The scheduler's plan per device name: each device's share of the footprint, the
/// host's part as [`HOST`].
fn planned_shares(all: &[command::Device], child: &command::Placement, request: &StartRequest) -> Vec<(String, u64)> {
    let footprint = request.footprint;
    let mut planned: Vec<(String, u64)> = Vec::new();
    if let Some(plan) = &child.plan {
        for (index, device) in request.placement.devices().iter().zip(&plan.devices) {
            if all.get(*index).is_some() {
                planned.push((device.name.clone(), request.placement.vram_on(*index, footprint.vram)));
            }
        }
    }
    planned.push((HOST.to_owned(), request.placement.host_bytes(footprint)));
    planned
}

struct SupervisedRunner {
    runner: Runner,
    probe: Option<Arc<dyn MemoryProbe>>,
    planned: Vec<(String, u64)>,
    buffers: Vec<PlannedDevice>,
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

    fn devices(&self) -> Vec<DeviceMemory> {
        runner::device_memory(&self.planned, &self.buffers, self.runner.report())
    }

    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.runner.stop().await;
        })
    }

    fn kill(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.runner.kill().await;
        })
    }

    fn exited(&mut self) -> BoxFuture<'_, String> {
        Box::pin(async move { self.runner.exited().await.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::{Placement, child_placement};
    use crate::supervisor::command::{Backend, Device, PlannedDevice};

    fn device(backend: Backend, id: &str) -> Device {
        Device { backend, id: id.into() }
    }

    #[test]
    fn devices_get_llama_cpp_names_and_workers_their_buffer_names() {
        // Two local GPUs, a worker with two devices, a worker with one.
        let all = vec![
            device(Backend::Cuda, "GPU-a"),
            device(Backend::Cuda, "GPU-b"),
            device(Backend::Rpc, "10.0.0.2:50052"),
            device(Backend::Rpc, "10.0.0.2:50052"),
            device(Backend::Rpc, "10.0.0.3:50052"),
        ];
        let child = child_placement(&all, &Placement::Spread(vec![(1, 2 << 30), (3, 1 << 30), (4, 1 << 30)]));
        assert_eq!(child.devices, [device(Backend::Cuda, "GPU-b")], "only the chosen GPU is visible");
        assert_eq!(child.rpc_servers, ["10.0.0.2:50052", "10.0.0.3:50052"]);
        let plan = child.plan.expect("a plan");
        assert_eq!(
            plan.devices,
            [
                PlannedDevice { name: "CUDA0".into(), buffer: "CUDA0".into(), share: 2048 },
                // Every device of a worker given to --rpc counts, in order.
                PlannedDevice { name: "RPC1".into(), buffer: "RPC1[10.0.0.2:50052]".into(), share: 1024 },
                PlannedDevice { name: "RPC2".into(), buffer: "RPC0[10.0.0.3:50052]".into(), share: 1024 },
            ]
        );
        assert_eq!(plan.layers, None, "all layers");
        let partial = child_placement(&all, &Placement::Partial { shares: vec![(4, 1 << 30)], layers: 5, of: 9 });
        let plan = partial.plan.expect("a plan");
        assert_eq!((plan.devices[0].name.as_str(), plan.layers), ("RPC0", Some(5)));
        let cpu = child_placement(&all, &Placement::Cpu);
        assert!(cpu.devices.is_empty() && cpu.rpc_servers.is_empty());
        assert!(cpu.plan.expect("a plan").devices.is_empty(), "the CPU alone");
    }
}
