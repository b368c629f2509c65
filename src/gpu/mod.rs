//! Devices and host memory: what the scheduler fits models into.
//!
//! A [`MemoryProbe`] answers with an owned [`Inventory`] snapshot each time it is asked.
//! [`probe`] picks one from the configuration: the fixed inventory of `[gpu] devices`
//! (CPU-only hosts, tests), or a [`SystemProbe`] that combines NVIDIA GPUs through NVML
//! ([`nvml`]; no library means no NVIDIA GPUs), AMD GPUs through sysfs ([`amd`]) and host
//! memory from `/proc/meminfo` ([`host`]).  The devices of the `[[workers]]` (ggml
//! `rpc-server`s, listed by [`rpc`]) follow the local GPUs; the health monitor
//! ([`crate::workers`]) adds them as the workers come up and takes them out (by index, in
//! [`Inventory::offline`]) as they go down.  Every filesystem root, program and the NVML
//! handle are passed in, so tests point them at a temporary directory.
//! What corral's runners take on each device is the scheduler's view
//! ([`crate::scheduler::device_use`]).

pub mod amd;
pub mod fixed;
pub mod host;
pub mod nvml;
pub mod rpc;

use std::path::PathBuf;

pub use crate::supervisor::command::Backend;

use crate::config::GpuConfig;

/// Everything the scheduler plans with, at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inventory {
    /// Every offload device: the local GPUs (NVIDIA first, then AMD, each in its driver's
    /// order), then the workers' RPC devices (in `[[workers]]` order).
    pub gpus: Vec<Gpu>,
    /// The host's memory.
    pub host: HostMemory,
    /// The indices in `gpus` of devices whose worker is down: kept, so that indices stay
    /// stable, but planned with and listed by no one.
    pub offline: std::collections::BTreeSet<usize>,
}

impl Inventory {
    /// The devices that can be used now, with their indices.
    pub fn online(&self) -> impl Iterator<Item = (usize, &Gpu)> {
        self.gpus.iter().enumerate().filter(|(index, _)| !self.offline.contains(index))
    }
}

/// One offload device: a local GPU, or a worker's RPC device.
///
/// With [`probe`], `total_bytes` and `free_bytes` are already less `[gpu] reserve` (and
/// capped by the worker's `memory`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Its index among the GPUs of its backend, as the driver counts them; for an RPC
    /// device, its position among its worker's devices.
    pub index: u32,
    /// A stable id: the UUID (`GPU-…`) where the driver has one, else the PCI address;
    /// `rpc:HOST:PORT#N` for a worker's device.
    pub id: String,
    /// Its product name; for an RPC device, its worker's name (with `#N` when the
    /// worker has several devices).
    pub name: String,
    /// Its driver family.
    pub backend: Backend,
    /// Its memory in bytes.
    pub total_bytes: u64,
    /// Its memory not in use by anyone, in bytes.
    pub free_bytes: u64,
    /// The driver's version, when known.
    pub driver: Option<String>,
    /// Its compute capability (`"8.9"` for CUDA), when known.
    pub compute: Option<String>,
    /// For an RPC device ([`Backend::Rpc`]): its worker's `host:port`.
    pub endpoint: Option<String>,
}

/// The host's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostMemory {
    /// Installed memory in bytes (`MemTotal`).
    pub total_bytes: u64,
    /// Memory available for new work without swapping, in bytes (`MemAvailable`).
    pub available_bytes: u64,
}

/// A source of memory facts.
pub trait MemoryProbe: Send + Sync {
    /// The GPUs and host memory now.  Never fails: what cannot be read is left out
    /// (and logged).
    fn inventory(&self) -> Inventory;

    /// GPU memory in bytes used by the process `pid`, summed over all GPUs; `None` when
    /// this probe cannot tell.
    fn process_vram(&self, pid: u32) -> Option<u64> {
        let _ = pid;
        None
    }
}

/// Where the kernel's filesystems are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    /// sysfs, normally `/sys`.
    pub sys: PathBuf,
    /// procfs, normally `/proc`.
    pub proc: PathBuf,
}

impl Roots {
    /// The real ones: `/sys` and `/proc`.
    #[must_use]
    pub fn system() -> Self {
        Self { sys: PathBuf::from("/sys"), proc: PathBuf::from("/proc") }
    }
}

/// The probe for this configuration: the fixed inventory when `[gpu] fixed` is set, else a
/// [`SystemProbe`] with NVML (when its library loads), AMD sysfs and `/proc/meminfo`.
/// Either way `[gpu] reserve` is taken off every device's total and free memory.
#[must_use]
pub fn probe(config: &GpuConfig, roots: &Roots) -> Box<dyn MemoryProbe> {
    let inner: Box<dyn MemoryProbe> = if config.fixed {
        tracing::info!(gpus = config.devices.len(), "using the fixed GPU inventory from [gpu]");
        Box::new(fixed::FixedProbe::new(config, roots))
    } else {
        if !config.devices.is_empty() {
            tracing::warn!("[gpu] devices are ignored unless [gpu] fixed = true; probing the GPUs");
        }
        Box::new(SystemProbe::new(nvml::NvmlProbe::new(), roots.clone()))
    };
    if config.reserve == 0 { inner } else { Box::new(Reserved { inner, reserve: config.reserve }) }
}

/// The GPUs and host memory of this machine.
#[derive(Debug)]
pub struct SystemProbe {
    nvml: nvml::NvmlProbe,
    roots: Roots,
}

impl SystemProbe {
    /// A probe reading NVIDIA GPUs through `nvml`, AMD GPUs and host memory under `roots`.
    #[must_use]
    pub fn new(nvml: nvml::NvmlProbe, roots: Roots) -> Self {
        Self { nvml, roots }
    }
}

impl MemoryProbe for SystemProbe {
    fn inventory(&self) -> Inventory {
        let mut gpus = self.nvml.gpus();
        gpus.extend(amd::gpus(&self.roots.sys));
        let host = host::read(&self.roots.proc).unwrap_or_else(|e| {
            tracing::warn!("host memory unknown: {e}");
            HostMemory::default()
        });
        Inventory { gpus, host, offline: std::collections::BTreeSet::new() }
    }

    fn process_vram(&self, pid: u32) -> Option<u64> {
        self.nvml.process_vram(pid)
    }
}

/// Another probe with `reserve` bytes taken off every GPU.
struct Reserved {
    inner: Box<dyn MemoryProbe>,
    reserve: u64,
}

impl MemoryProbe for Reserved {
    fn inventory(&self) -> Inventory {
        let mut inventory = self.inner.inventory();
        for gpu in &mut inventory.gpus {
            reserve(gpu, self.reserve);
        }
        inventory
    }

    fn process_vram(&self, pid: u32) -> Option<u64> {
        self.inner.process_vram(pid)
    }
}

/// Takes `bytes` off a GPU's total and free memory, stopping at zero.
pub fn reserve(gpu: &mut Gpu, bytes: u64) {
    gpu.total_bytes = gpu.total_bytes.saturating_sub(bytes);
    gpu.free_bytes = gpu.free_bytes.saturating_sub(bytes);
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::{Backend, Gpu, HostMemory, Roots, probe, reserve};
    use crate::config::{FixedGpu, GpuConfig};

    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * MIB;

    /// A fake `/sys` with one AMD card and a fake `/proc` with 16 GiB of memory.
    fn fake_roots(dir: &Path) -> Roots {
        let card = dir.join("sys/class/drm/card1/device");
        fs::create_dir_all(&card).expect("mkdir");
        fs::write(card.join("vendor"), "0x1002\n").expect("write");
        fs::write(card.join("mem_info_vram_total"), format!("{}\n", 16 * GIB)).expect("write");
        fs::write(card.join("mem_info_vram_used"), format!("{GIB}\n")).expect("write");
        fs::create_dir_all(dir.join("proc")).expect("mkdir");
        fs::write(dir.join("proc/meminfo"), "MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n").expect("write");
        Roots { sys: dir.join("sys"), proc: dir.join("proc") }
    }

    fn fixed_config() -> GpuConfig {
        GpuConfig {
            fixed: true,
            host_memory: Some(32 * GIB),
            devices: vec![
                FixedGpu { name: "test0".into(), memory: 8 * GIB, backend: Backend::Cuda, id: None },
                FixedGpu { name: "test1".into(), memory: 4 * GIB, backend: Backend::Vulkan, id: Some("x".into()) },
            ],
            reserve: 0,
        }
    }

    #[test]
    fn system_roots_are_sys_and_proc() {
        let roots = Roots::system();
        assert_eq!(roots.sys, Path::new("/sys"));
        assert_eq!(roots.proc, Path::new("/proc"));
    }

    #[test]
    fn probe_uses_the_fixed_inventory_when_configured_and_probes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = fake_roots(dir.path());
        let inventory = probe(&fixed_config(), &roots).inventory();
        let names: Vec<_> = inventory.gpus.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["test0", "test1"], "the AMD card under the fake sysfs is not probed");
        assert_eq!(inventory.host, HostMemory { total_bytes: 32 * GIB, available_bytes: 32 * GIB });
        assert_eq!(probe(&fixed_config(), &roots).process_vram(1), None);
    }

    #[test]
    fn probe_reads_the_system_otherwise() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = fake_roots(dir.path());
        let mut config = fixed_config();
        config.fixed = false;
        let inventory = probe(&config, &roots).inventory();
        assert!(inventory.gpus.iter().all(|g| g.name != "test0"), "configured devices are ignored");
        let amd: Vec<_> = inventory.gpus.iter().filter(|g| g.backend == Backend::Rocm).collect();
        assert_eq!(amd.len(), 1, "{inventory:?}");
        assert_eq!((amd[0].total_bytes, amd[0].free_bytes), (16 * GIB, 15 * GIB));
        assert_eq!(inventory.host, HostMemory { total_bytes: 16 * GIB, available_bytes: 8 * GIB });
    }

    #[test]
    fn the_reserve_comes_off_fixed_and_probed_gpus() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roots = fake_roots(dir.path());
        let mut config = fixed_config();
        config.reserve = 512 * MIB;
        let fixed = probe(&config, &roots).inventory();
        assert_eq!(fixed.gpus[0].total_bytes, 8 * GIB - 512 * MIB);
        assert_eq!(fixed.gpus[1].free_bytes, 4 * GIB - 512 * MIB);
        assert_eq!(fixed.host.total_bytes, 32 * GIB, "host memory has no reserve");

        config.fixed = false;
        let probed = probe(&config, &roots).inventory();
        let amd = probed.gpus.iter().find(|g| g.backend == Backend::Rocm).expect("AMD card");
        assert_eq!((amd.total_bytes, amd.free_bytes), (16 * GIB - 512 * MIB, 15 * GIB - 512 * MIB));
    }

    #[test]
    fn a_reserve_larger_than_the_gpu_leaves_zero() {
        let mut gpu = Gpu {
            index: 0,
            id: "0".into(),
            name: "tiny".into(),
            backend: Backend::Cuda,
            total_bytes: GIB,
            free_bytes: 100 * MIB,
            driver: None,
            compute: None,
            endpoint: None,
        };
        reserve(&mut gpu, 512 * MIB);
        assert_eq!((gpu.total_bytes, gpu.free_bytes), (512 * MIB, 0));
        reserve(&mut gpu, 2 * GIB);
        assert_eq!((gpu.total_bytes, gpu.free_bytes), (0, 0));
    }
}
