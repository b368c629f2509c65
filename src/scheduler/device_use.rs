//! Per-device use: the inventory with what corral's runners take on each device, for the
//! views (D-Bus `Devices`, `/metrics`, `/api/ps`).  Pure: the caller brings the scheduler's
//! runners.

use super::policy::{Footprint, Placement};
use super::types::LoadedModel;
use crate::gpu::Inventory;

/// The host's name among the devices.
pub const HOST_NAME: &str = "host";

/// One device, or the host, with corral's use of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceUse {
    /// `cuda`, `rocm`, `vulkan`, `rpc`, or `host`.
    pub kind: &'static str,
    /// Its stable id ([`HOST_NAME`] for the host).
    pub name: String,
    /// Its product name, or its worker's name.
    pub description: String,
    /// Its memory in bytes.
    pub total_bytes: u64,
    /// What corral may plan with: free memory less the reserve (capped by a worker's
    /// `memory`), or the host's available memory.
    pub usable_bytes: u64,
    /// What corral's runners take on it now.
    pub used_bytes: u64,
}

/// Every device of `inventory` that is online, in its order, then the host, with what
/// `loaded` takes.
#[must_use]
pub fn usage(inventory: &Inventory, loaded: &[LoadedModel]) -> Vec<DeviceUse> {
    let mut devices: Vec<DeviceUse> = inventory
        .online()
        .map(|(index, gpu)| DeviceUse {
            kind: gpu.backend.as_str(),
            name: gpu.id.clone(),
            description: gpu.name.clone(),
            total_bytes: gpu.total_bytes,
            usable_bytes: gpu.free_bytes,
            used_bytes: loaded.iter().map(|m| m.placement.vram_on(index, m.footprint.vram)).sum(),
        })
        .collect();
    devices.push(DeviceUse {
        kind: HOST_NAME,
        name: HOST_NAME.to_owned(),
        description: "host memory".to_owned(),
        total_bytes: inventory.host.total_bytes,
        usable_bytes: inventory.host.available_bytes,
        used_bytes: loaded.iter().map(|m| m.placement.host_bytes(m.footprint)).sum(),
    });
    devices
}

/// Where one runner's memory is: (kind, device name, bytes) for each device it uses, the
/// host last; devices it does not use are left out.
#[must_use]
pub fn model_devices(
    inventory: &Inventory,
    placement: &Placement,
    footprint: Footprint,
) -> Vec<(&'static str, String, u64)> {
    let mut shares: Vec<(&'static str, String, u64)> = inventory
        .gpus
        .iter()
        .enumerate()
        .map(|(index, gpu)| (gpu.backend.as_str(), gpu.id.clone(), placement.vram_on(index, footprint.vram)))
        .filter(|(_, _, bytes)| *bytes > 0)
        .collect();
    let host = placement.host_bytes(footprint);
    if host > 0 {
        shares.push((HOST_NAME, HOST_NAME.to_owned(), host));
    }
    shares
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{DeviceUse, HOST_NAME, model_devices, usage};
    use crate::gpu::{Backend, Gpu, HostMemory, Inventory};
    use crate::scheduler::keep_alive::KeepAlive;
    use crate::scheduler::policy::{Footprint, Placement};
    use crate::scheduler::types::LoadedModel;

    fn device(index: u32, id: &str, backend: Backend, bytes: u64) -> Gpu {
        Gpu {
            index,
            id: id.into(),
            name: format!("{id} name"),
            backend,
            total_bytes: bytes,
            free_bytes: bytes - 10,
            driver: None,
            compute: None,
            endpoint: (backend == Backend::Rpc).then(|| "h:1".to_owned()),
        }
    }

    fn inventory() -> Inventory {
        Inventory {
            gpus: vec![device(0, "GPU-a", Backend::Cuda, 1000), device(0, "rpc:h:1#0", Backend::Rpc, 500)],
            host: HostMemory { total_bytes: 4000, available_bytes: 3000 },
            offline: std::collections::BTreeSet::new(),
        }
    }

    fn runner(id: u64, placement: Placement, vram: u64, ram: u64) -> LoadedModel {
        LoadedModel {
            devices: Vec::new(),
            id,
            name: format!("m{id}"),
            names: vec![format!("m{id}")],
            key: crate::scheduler::key::RunnerKey::new(
                crate::scheduler::key::Weights::of(crate::store::digest::Digest::of(&id.to_le_bytes())),
                &crate::supervisor::command::LoadOptions::default(),
            ),
            state: "ready",
            placement,
            footprint: Footprint { vram, ram },
            leases: 0,
            expires_at: None,
            keep_alive: KeepAlive::For(Duration::from_secs(1)),
            pid: None,
            context_length: 0,
            offload: None,
        }
    }

    #[test]
    fn every_device_then_the_host_with_what_the_runners_take() {
        let loaded = [
            runner(1, Placement::Gpu(1), 100, 7),
            runner(2, Placement::Spread(vec![(0, 300), (1, 50)]), 350, 3),
            runner(3, Placement::Cpu, 40, 2),
        ];
        let rows = usage(&inventory(), &loaded);
        let summary: Vec<_> =
            rows.iter().map(|d| (d.kind, d.name.as_str(), d.total_bytes, d.usable_bytes, d.used_bytes)).collect();
        assert_eq!(
            summary,
            [
                ("cuda", "GPU-a", 1000, 990, 300),
                ("rpc", "rpc:h:1#0", 500, 490, 150),
                ("host", HOST_NAME, 4000, 3000, 52)
            ]
        );
        let mut down = inventory();
        down.offline.insert(1);
        let online: Vec<_> = usage(&down, &loaded).into_iter().map(|d| d.name).collect();
        assert_eq!(online, ["GPU-a", HOST_NAME], "a down worker's device leaves the listing");
        let empty = usage(&Inventory::default(), &[]);
        assert_eq!(
            empty,
            [DeviceUse {
                kind: "host",
                name: "host".into(),
                description: "host memory".into(),
                total_bytes: 0,
                usable_bytes: 0,
                used_bytes: 0
            }]
        );
    }

    #[test]
    fn a_runners_devices_leave_out_the_ones_it_does_not_use() {
        let inv = inventory();
        let split = model_devices(&inv, &Placement::Spread(vec![(0, 0), (1, 80)]), Footprint { vram: 80, ram: 20 });
        assert_eq!(split, [("rpc", "rpc:h:1#0".to_owned(), 80), ("host", "host".to_owned(), 20)]);
        assert_eq!(
            model_devices(&inv, &Placement::Cpu, Footprint { vram: 5, ram: 1 }),
            [("host", "host".to_owned(), 6)]
        );
        assert_eq!(
            model_devices(&inv, &Placement::Gpu(0), Footprint { vram: 5, ram: 0 }),
            [("cuda", "GPU-a".to_owned(), 5)]
        );
    }
}
