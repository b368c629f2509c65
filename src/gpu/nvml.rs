//! NVIDIA GPUs through NVML (`libnvidia-ml.so`, loaded at run time).
//!
//! The library is optional: when it does not load, or the driver is not running, there
//! are no NVIDIA GPUs, said once in the log when the probe is made.

use std::ffi::OsStr;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::{Backend, Gpu};

/// NVIDIA GPUs, or none when NVML is not available.
#[derive(Debug)]
pub struct NvmlProbe {
    nvml: Option<Nvml>,
}

impl NvmlProbe {
    /// Loads the system's NVML; without it the probe finds no GPUs.
    #[must_use]
    pub fn new() -> Self {
        Self::from_init(Nvml::init())
    }

    /// Loads NVML from `path` instead of the system's; without it the probe finds no GPUs.
    #[must_use]
    pub fn with_library(path: &OsStr) -> Self {
        Self::from_init(Nvml::builder().lib_path(path).init())
    }

    /// A probe that finds no GPUs.
    #[must_use]
    pub fn unavailable() -> Self {
        Self { nvml: None }
    }

    fn from_init(init: Result<Nvml, NvmlError>) -> Self {
        match init {
            Ok(nvml) => Self { nvml: Some(nvml) },
            Err(e) => {
                tracing::info!("no NVIDIA GPUs: NVML is not available: {e}");
                Self::unavailable()
            }
        }
    }

    /// Whether NVML loaded.
    #[must_use]
    pub fn is_available(&self) -> bool {
        self.nvml.is_some()
    }

    /// The NVIDIA GPUs in NVML's order; a device that cannot be read is left out.
    #[must_use]
    pub fn gpus(&self) -> Vec<Gpu> {
        let Some(nvml) = &self.nvml else { return Vec::new() };
        let count = nvml.device_count().unwrap_or_else(|e| {
            tracing::warn!("NVML cannot count the GPUs: {e}");
            0
        });
        let driver = nvml.sys_driver_version().ok();
        (0..count)
            .filter_map(|index| {
                read_device(nvml, index, driver.clone())
                    .inspect_err(|e| tracing::debug!("skipping NVIDIA GPU {index}: {e}"))
                    .ok()
            })
            .collect()
    }

    /// GPU memory used by `pid` summed over every GPU, from the running compute processes;
    /// `None` without NVML, or when a GPU the process runs on does not report it.
    #[must_use]
    pub fn process_vram(&self, pid: u32) -> Option<u64> {
        let nvml = self.nvml.as_ref()?;
        let mut total = 0_u64;
        let mut answered = false;
        for index in 0..nvml.device_count().ok()? {
            let Ok(processes) = nvml.device_by_index(index).and_then(|d| d.running_compute_processes()) else {
                continue;
            };
            answered = true;
            for process in processes.iter().filter(|p| p.pid == pid) {
                match process.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => total = total.saturating_add(bytes),
                    UsedGpuMemory::Unavailable => return None,
                }
            }
        }
        answered.then_some(total)
    }
}

impl Default for NvmlProbe {
    fn default() -> Self {
        Self::new()
    }
}

fn read_device(nvml: &Nvml, index: u32, driver: Option<String>) -> Result<Gpu, NvmlError> {
    let device = nvml.device_by_index(index)?;
    let memory = device.memory_info()?;
    let compute = device.cuda_compute_capability().ok().map(|c| format!("{}.{}", c.major, c.minor));
    Ok(Gpu {
        index,
        id: device.uuid()?,
        name: device.name()?,
        backend: Backend::Cuda,
        total_bytes: memory.total,
        free_bytes: memory.free,
        driver,
        compute,
        endpoint: None,
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::{Backend, NvmlProbe};

    #[test]
    fn a_library_that_does_not_load_means_no_gpus() {
        let probe = NvmlProbe::with_library(OsStr::new("/nonexistent/libnvidia-ml.so.1"));
        assert!(!probe.is_available());
        assert!(probe.gpus().is_empty());
        assert_eq!(probe.process_vram(std::process::id()), None);
    }

    #[test]
    fn unavailable_finds_nothing() {
        let probe = NvmlProbe::unavailable();
        assert!(!probe.is_available());
        assert!(probe.gpus().is_empty());
        assert_eq!(probe.process_vram(1), None);
    }

    /// The system's NVML: on a machine without it (CI, development) this is the failure
    /// path and finds nothing; on a machine with NVIDIA GPUs it finds them.
    #[test]
    fn the_system_library_never_panics() {
        let probe = NvmlProbe::new();
        let gpus = probe.gpus();
        if !probe.is_available() {
            assert!(gpus.is_empty());
            assert_eq!(probe.process_vram(std::process::id()), None);
            return;
        }
        for (i, gpu) in gpus.iter().enumerate() {
            assert_eq!(gpu.backend, Backend::Cuda);
            assert!(gpu.index as usize >= i);
            assert!(gpu.id.starts_with("GPU-") || gpu.id.starts_with("MIG-"), "{gpu:?}");
            assert!(gpu.total_bytes > 0 && gpu.free_bytes <= gpu.total_bytes, "{gpu:?}");
        }
        assert_eq!(probe.process_vram(std::process::id()), Some(0), "this test uses no GPU");
    }
}
