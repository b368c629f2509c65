//! The fixed inventory of `[gpu] fixed = true`: the configured devices, nothing probed.

use std::path::PathBuf;

use super::{Gpu, HostMemory, Inventory, MemoryProbe, Roots, host};
use crate::config::GpuConfig;

/// The GPUs of `[gpu] devices`, all memory free, and `[gpu] host_memory` (else the host's
/// `/proc/meminfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedProbe {
    gpus: Vec<Gpu>,
    host: Option<HostMemory>,
    proc: PathBuf,
}

impl FixedProbe {
    /// The inventory `config` describes; `roots.proc` is read only when it sets no host memory.
    #[must_use]
    pub fn new(config: &GpuConfig, roots: &Roots) -> Self {
        let gpus = config
            .devices
            .iter()
            .zip(0_u32..)
            .map(|(device, index)| Gpu {
                index,
                id: device.id.clone().unwrap_or_else(|| index.to_string()),
                name: device.name.clone(),
                backend: device.backend,
                total_bytes: device.memory,
                free_bytes: device.memory,
                driver: None,
                compute: None,
                endpoint: None,
            })
            .collect();
        let host = config.host_memory.map(|bytes| HostMemory { total_bytes: bytes, available_bytes: bytes });
        Self { gpus, host, proc: roots.proc.clone() }
    }
}

impl MemoryProbe for FixedProbe {
    fn inventory(&self) -> Inventory {
        let host = self.host.unwrap_or_else(|| {
            host::read(&self.proc).unwrap_or_else(|e| {
                tracing::warn!("host memory unknown: {e}");
                HostMemory::default()
            })
        });
        Inventory { gpus: self.gpus.clone(), host, offline: std::collections::BTreeSet::new() }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::{FixedProbe, HostMemory, MemoryProbe, Roots};
    use crate::config::{FixedGpu, GpuConfig};
    use crate::gpu::Backend;

    const GIB: u64 = 1024 * 1024 * 1024;

    fn roots(dir: &std::path::Path) -> Roots {
        Roots { sys: dir.join("sys"), proc: dir.join("proc") }
    }

    #[test]
    fn devices_are_indexed_in_order_with_all_memory_free() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = GpuConfig {
            fixed: true,
            host_memory: Some(16 * GIB),
            devices: vec![
                FixedGpu { name: "test0".into(), memory: 8 * GIB, backend: Backend::Cuda, id: None },
                FixedGpu { name: "test1".into(), memory: 4 * GIB, backend: Backend::Rocm, id: Some("GPU-x".into()) },
            ],
            reserve: 0,
        };
        let probe = FixedProbe::new(&config, &roots(dir.path()));
        let inventory = probe.inventory();
        assert_eq!(inventory.host, HostMemory { total_bytes: 16 * GIB, available_bytes: 16 * GIB });
        let [a, b] = &inventory.gpus[..] else { panic!("two GPUs: {inventory:?}") };
        assert_eq!((a.index, a.id.as_str(), a.name.as_str(), a.backend), (0, "0", "test0", Backend::Cuda));
        assert_eq!((a.total_bytes, a.free_bytes), (8 * GIB, 8 * GIB));
        assert_eq!((b.index, b.id.as_str(), b.name.as_str(), b.backend), (1, "GPU-x", "test1", Backend::Rocm));
        assert_eq!((b.driver.as_deref(), b.compute.as_deref()), (None, None));
        assert_eq!(probe.process_vram(1), None);
    }

    #[test]
    fn without_host_memory_the_hosts_meminfo_is_read_on_each_inventory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = GpuConfig { fixed: true, ..GpuConfig::default() };
        let probe = FixedProbe::new(&config, &roots(dir.path()));
        assert_eq!(probe.inventory().host, HostMemory::default(), "unreadable: zero, logged");
        fs::create_dir_all(dir.path().join("proc")).expect("mkdir");
        fs::write(dir.path().join("proc/meminfo"), "MemTotal: 4 kB\nMemAvailable: 2 kB\n").expect("write");
        let inventory = probe.inventory();
        assert!(inventory.gpus.is_empty());
        assert_eq!(inventory.host, HostMemory { total_bytes: 4096, available_bytes: 2048 });
    }
}
