//! Scheduling decisions as pure functions of a snapshot: where a model fits, and which
//! runners make room when it does not. No IO, no clock (the time comes in), no logging.

use std::time::Instant;

use super::keep_alive::KeepAlive;

/// A runner's identity while it exists.
pub type RunnerId = u64;

/// Memory a model needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// On GPUs, when it runs on GPUs (weights, KV cache, compute buffers).
    pub vram: u64,
    /// In host memory besides (output buffers, the projector on the CPU, …).
    pub ram: u64,
}

impl Footprint {
    /// Everything, when it runs on the CPU.
    #[must_use]
    pub fn total(self) -> u64 {
        self.vram.saturating_add(self.ram)
    }
}

/// The conservative estimate used until a model was loaded once: weights, an f16 KV
/// cache for the whole context, the projector, and a compute margin (a tenth of the
/// weights, at least 256 MiB).
#[must_use]
pub fn estimate(weights: u64, kv_cache: u64, projector: u64) -> Footprint {
    let margin = (weights / 10).max(256 << 20);
    Footprint { vram: weights.saturating_add(kv_cache).saturating_add(projector).saturating_add(margin), ram: 64 << 20 }
}

/// What a model needs, and how it can be cut.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Need {
    /// Memory with every layer on one device (`vram`), and beside it in host memory.
    pub footprint: Footprint,
    /// The layers llama.cpp can offload (the blocks and the output layer); 0 when unknown,
    /// which rules out a partial offload.
    pub layers: u32,
    /// What every device that takes a part needs besides its share of the layers (its
    /// compute buffers): included once in `footprint.vram`, paid again by each further
    /// device of a split.
    pub per_device: u64,
}

impl From<Footprint> for Need {
    fn from(footprint: Footprint) -> Self {
        Self { footprint, layers: 0, per_device: 0 }
    }
}

/// A GPU as the scheduler plans with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// Its index in the inventory.
    pub index: usize,
    /// Its name, for messages.
    pub name: String,
    /// For a device of an RPC worker, the worker (its address): a worker serves one
    /// runner at a time.
    pub worker: Option<String>,
    /// What corral may use on it: total, less the configured reserve and what other
    /// processes use.
    pub usable: u64,
}

impl GpuView {
    /// Every device of `inventory` (offline ones too: the scheduler leaves those out when
    /// it plans), by its inventory index.
    #[must_use]
    pub fn all(inventory: &crate::gpu::Inventory) -> Vec<Self> {
        inventory
            .gpus
            .iter()
            .enumerate()
            .map(|(index, g)| Self { index, name: g.name.clone(), worker: g.endpoint.clone(), usable: g.free_bytes })
            .collect()
    }
}

/// A loaded (or loading) runner as the scheduler plans with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerView {
    /// Its id.
    pub id: RunnerId,
    /// Where it runs.
    pub placement: Placement,
    /// What it uses.
    pub footprint: Footprint,
    /// Requests holding it now.
    pub leases: u32,
    /// Its keep-alive.
    pub keep_alive: KeepAlive,
    /// When its last request ended (or it became ready).
    pub last_used: Instant,
    /// Never evicted.
    pub pinned: bool,
    /// Still starting: cannot be evicted yet, its memory is already counted.
    pub loading: bool,
    /// Taking no new requests; unloads when its leases end.
    pub draining: bool,
}

/// Everything a decision depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The GPUs.
    pub gpus: Vec<GpuView>,
    /// Host memory corral may use for models.
    pub host_usable: u64,
    /// The runners.
    pub runners: Vec<RunnerView>,
    /// Most runners at once.
    pub max_loaded: usize,
    /// Whether a model too big for the devices may run partly on the CPU.
    pub partial_offload: bool,
}

/// Where a model runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// On one GPU.
    Gpu(usize),
    /// Split over several GPUs: each index with the bytes it takes, in proportion to the
    /// room each had (how llama.cpp splits by default).
    Spread(Vec<(usize, u64)>),
    /// `layers` of the model's `of` layers on GPUs (each index with the bytes it takes),
    /// the rest on the CPU.
    Partial {
        /// Each GPU with the bytes it takes.
        shares: Vec<(usize, u64)>,
        /// Layers on the GPUs.
        layers: u32,
        /// The model's offloadable layers.
        of: u32,
    },
    /// On the CPU, in host memory.
    Cpu,
}

/// What to do about a model that is not loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Load it there now.
    Load(Placement),
    /// Make room: unload the idle `evict` now, stop giving `drain` new requests (they
    /// unload when their requests end), then decide again.
    MakeRoom {
        /// Idle runners to unload now.
        evict: Vec<RunnerId>,
        /// Busy runners to unload once idle.
        drain: Vec<RunnerId>,
    },
    /// Room is being made (runners unloading or draining, or loads in flight); decide
    /// again when one of them changes.
    Wait,
    /// It cannot fit even with every evictable runner gone.
    NoFit {
        /// Bytes it needs: on one GPU, or in host memory when there are none.
        needed: u64,
        /// The most that could be made available there (0: only the count limit stands
        /// in the way).
        available: u64,
        /// Each GPU with the room that could be made on it.
        gpus: Vec<(usize, u64)>,
        /// The host memory that could be made available.
        host: u64,
    },
}

/// Decides how to load a model that needs `need`.
#[must_use]
pub fn decide(snapshot: &Snapshot, need: impl Into<Need>) -> Decision {
    let need = need.into();
    let all: Vec<&RunnerView> = snapshot.runners.iter().collect();
    if all.len() < snapshot.max_loaded.max(1) {
        if let Some(placement) = place(snapshot, &all, need) {
            return Decision::Load(placement);
        }
    }
    // Make room: idle runners first, shortest keep-alive first, then least recently used;
    // busy ones only when the idle ones are not enough.
    let mut candidates: Vec<&RunnerView> =
        snapshot.runners.iter().filter(|r| !r.pinned && !r.loading && !r.draining).collect();
    candidates.sort_by_key(|r| (r.leases > 0, r.keep_alive, r.last_used, r.id));
    let mut remaining = all.clone();
    let mut chosen = Vec::new();
    for victim in candidates {
        remaining.retain(|r| r.id != victim.id);
        chosen.push(victim);
        let in_flight = remaining.iter().any(|r| r.draining);
        if remaining.len() < snapshot.max_loaded.max(1) && !in_flight && place(snapshot, &remaining, need).is_some() {
            let (drain, evict): (Vec<&RunnerView>, Vec<&RunnerView>) = chosen.iter().partition(|r| r.leases > 0);
            return Decision::MakeRoom {
                evict: evict.iter().map(|r| r.id).collect(),
                drain: drain.iter().map(|r| r.id).collect(),
            };
        }
    }
    // Nothing more to evict. Runners on their way out, or loads in flight, may still free
    // (or settle) memory: wait for them rather than fail.
    if snapshot.runners.iter().any(|r| r.draining || r.loading) {
        return Decision::Wait;
    }
    let kept: Vec<&RunnerView> = snapshot.runners.iter().filter(|r| r.pinned).collect();
    let gpus: Vec<(usize, u64)> = snapshot.gpus.iter().map(|g| (g.index, gpu_free(&snapshot.gpus, g, &kept))).collect();
    let host = host_free(snapshot, &kept);
    let footprint = need.footprint;
    if place(snapshot, &kept, need).is_some() {
        // Only the count limit stands in the way, and pinned runners fill it.
        return Decision::NoFit { needed: footprint.total(), available: 0, gpus, host };
    }
    let most_free_gpu = gpus.iter().map(|(_, room)| *room).max().unwrap_or(0);
    let (needed, available) =
        if snapshot.gpus.is_empty() { (footprint.total(), host) } else { (footprint.vram, most_free_gpu) };
    Decision::NoFit { needed, available, gpus, host }
}

/// Which runners go so that at most `max_loaded` stay (after a reload lowered the
/// limit): `evict` idle ones now, `drain` busy ones (they unload when their requests
/// end); idle ones first, in eviction order (shortest keep-alive, least recently used).
/// Runners already on their way out count as gone; pinned and loading ones are never
/// chosen (a loading one is decided on once it is ready).
#[must_use]
pub fn shed(snapshot: &Snapshot) -> Option<Decision> {
    let staying = snapshot.runners.iter().filter(|r| !r.draining).count();
    let excess = staying.saturating_sub(snapshot.max_loaded.max(1));
    if excess == 0 {
        return None;
    }
    let mut candidates: Vec<&RunnerView> =
        snapshot.runners.iter().filter(|r| !r.pinned && !r.loading && !r.draining).collect();
    candidates.sort_by_key(|r| (r.leases > 0, r.keep_alive, r.last_used, r.id));
    candidates.truncate(excess);
    if candidates.is_empty() {
        return None;
    }
    let (drain, evict): (Vec<&RunnerView>, Vec<&RunnerView>) = candidates.iter().partition(|r| r.leases > 0);
    Some(Decision::MakeRoom {
        evict: evict.iter().map(|r| r.id).collect(),
        drain: drain.iter().map(|r| r.id).collect(),
    })
}

/// Where `need` fits next to `runners`, if anywhere: one GPU (the one with most room),
/// else spread over GPUs, else (when allowed) partly on GPUs and the rest on the CPU,
/// else the CPU when there are no GPUs.
fn place(snapshot: &Snapshot, runners: &[&RunnerView], need: Need) -> Option<Placement> {
    let (layers, per_device, need) = (need.layers, need.per_device.min(need.footprint.vram), need.footprint);
    let host = host_free(snapshot, runners);
    if snapshot.gpus.is_empty() {
        return (host >= need.total()).then_some(Placement::Cpu);
    }
    if host < need.ram {
        return None;
    }
    let mut free: Vec<(usize, u64)> =
        snapshot.gpus.iter().map(|g| (g.index, gpu_free(&snapshot.gpus, g, runners))).collect();
    free.sort_by_key(|(index, bytes)| (std::cmp::Reverse(*bytes), *index));
    if let Some((index, _)) = free.first().filter(|(_, bytes)| *bytes >= need.vram) {
        return Some(Placement::Gpu(*index));
    }
    // Each device of a split pays its own compute buffers: the layers share what is left.
    let mut usable: Vec<(usize, u64)> =
        free.into_iter().filter(|(_, bytes)| *bytes > per_device).map(|(i, bytes)| (i, bytes - per_device)).collect();
    let layered = need.vram - per_device;
    let total: u64 = usable.iter().map(|(_, bytes)| bytes).sum();
    if usable.len() > 1 && total >= layered {
        usable.sort_unstable();
        // Shares in proportion to the room; rounding up never takes more than the room.
        let shares = usable
            .iter()
            .map(|(index, room)| {
                let share = u128::from(layered) * u128::from(*room) / u128::from(total);
                (*index, u64::try_from(share).unwrap_or(u64::MAX).min(*room) + per_device)
            })
            .collect();
        return Some(Placement::Spread(shares));
    }
    if snapshot.partial_offload {
        partial(&usable, host, Footprint { vram: layered, ram: need.ram }, layers, per_device)
    } else {
        None
    }
}

/// As many whole layers on the GPUs with room as fit there, the rest in host memory: a
/// layer is taken to cost an equal share of the model's GPU footprint without the compute
/// buffers (the output layer included, so the estimate errs on the safe side); `usable`
/// is each GPU's room less its compute buffers, which its share then adds.
fn partial(usable: &[(usize, u64)], host: u64, need: Footprint, layers: u32, per_device: u64) -> Option<Placement> {
    if layers < 2 {
        return None;
    }
    let per_layer = need.vram.div_ceil(u64::from(layers)).max(1);
    let mut left = layers - 1; // at least one on the CPU, or it would have been a full offload
    let mut shares = Vec::new();
    for (index, room) in usable {
        let here = u32::try_from(room / per_layer).unwrap_or(u32::MAX).min(left);
        if here > 0 {
            shares.push((*index, u64::from(here) * per_layer + per_device));
            left -= here;
        }
    }
    let on_gpus = layers - 1 - left;
    let cpu_bytes = u64::from(layers - on_gpus).saturating_mul(per_layer);
    (on_gpus > 0 && host >= need.ram.saturating_add(cpu_bytes)).then_some(Placement::Partial {
        shares,
        layers: on_gpus,
        of: layers,
    })
}

/// Each GPU's room next to every runner of `snapshot`, by index.
#[must_use]
pub fn rooms(snapshot: &Snapshot) -> Vec<(usize, u64)> {
    let runners: Vec<&RunnerView> = snapshot.runners.iter().collect();
    snapshot.gpus.iter().map(|g| (g.index, gpu_free(&snapshot.gpus, g, &runners))).collect()
}

/// Free memory on a GPU next to `runners`.
fn gpu_free(gpus: &[GpuView], gpu: &GpuView, runners: &[&RunnerView]) -> u64 {
    if let Some(worker) = &gpu.worker {
        // An rpc-server serves one client at a time: a worker that holds a runner has no
        // room for another (nor for a projection) until that runner is gone.
        let worker_of = |index: usize| gpus.iter().find(|g| g.index == index).and_then(|g| g.worker.as_ref());
        if runners.iter().any(|r| r.placement.devices().into_iter().any(|i| worker_of(i) == Some(worker))) {
            return 0;
        }
    }
    gpu.usable.saturating_sub(runners.iter().map(|r| r.placement.vram_on(gpu.index, r.footprint.vram)).sum())
}

impl Placement {
    /// The inventory indices of its GPUs, in its order.
    #[must_use]
    pub fn devices(&self) -> Vec<usize> {
        match self {
            Self::Gpu(index) => vec![*index],
            Self::Spread(shares) | Self::Partial { shares, .. } => shares.iter().map(|(i, _)| *i).collect(),
            Self::Cpu => Vec::new(),
        }
    }

    /// The bytes of a runner using `vram` in total that sit on GPU `index`.
    #[must_use]
    pub fn vram_on(&self, index: usize, vram: u64) -> u64 {
        match self {
            Self::Gpu(i) if *i == index => vram,
            Self::Spread(shares) | Self::Partial { shares, .. } => {
                shares.iter().filter(|(i, _)| *i == index).map(|(_, bytes)| bytes).sum()
            }
            _ => 0,
        }
    }
}

impl Placement {
    /// The bytes of a runner with `footprint` that sit in host memory: all of a CPU
    /// runner's, a GPU runner's host part.
    #[must_use]
    pub fn host_bytes(&self, footprint: Footprint) -> u64 {
        if *self == Self::Cpu { footprint.total() } else { footprint.ram }
    }
}

/// Free host memory next to `runners`.
fn host_free(snapshot: &Snapshot, runners: &[&RunnerView]) -> u64 {
    let used: u64 = runners.iter().map(|r| r.placement.host_bytes(r.footprint)).sum();
    snapshot.host_usable.saturating_sub(used)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use proptest::prelude::{Strategy, any, prop_assert, proptest};

    use super::{
        Decision, Footprint, GpuView, KeepAlive, Need, Placement, RunnerView, Snapshot, decide, estimate, shed,
    };

    const GIB: u64 = 1 << 30;

    fn runner(id: u64, placement: Placement, vram: u64) -> RunnerView {
        RunnerView {
            id,
            placement,
            footprint: Footprint { vram, ram: 0 },
            leases: 0,
            keep_alive: KeepAlive::For(Duration::from_secs(300)),
            last_used: Instant::now(),
            pinned: false,
            loading: false,
            draining: false,
        }
    }

    fn gpus(sizes: &[u64]) -> Vec<GpuView> {
        sizes
            .iter()
            .enumerate()
            .map(|(index, gib)| GpuView { index, name: format!("gpu{index}"), worker: None, usable: gib * GIB })
            .collect()
    }

    fn need(gib: u64) -> Footprint {
        Footprint { vram: gib * GIB, ram: 0 }
    }

    #[test]
    fn the_estimate_is_conservative() {
        let f = estimate(4 * GIB, GIB, 0);
        assert_eq!(f.vram, 4 * GIB + GIB + 4 * GIB / 10);
        assert_eq!(estimate(1000, 0, 0).vram, 1000 + (256 << 20), "a floor for tiny models");
    }

    #[test]
    fn placement_prefers_one_gpu_then_spreads_then_fails() {
        let snap = |sizes: &[u64]| Snapshot {
            partial_offload: false,
            gpus: gpus(sizes),
            host_usable: 64 * GIB,
            runners: vec![],
            max_loaded: 3,
        };
        assert_eq!(decide(&snap(&[8, 24]), need(10)), Decision::Load(Placement::Gpu(1)), "the roomiest that fits");
        assert_eq!(decide(&snap(&[8, 8]), need(6)), Decision::Load(Placement::Gpu(0)), "ties go to the first");
        assert_eq!(
            decide(&snap(&[8, 8]), need(12)),
            Decision::Load(Placement::Spread(vec![(0, 6 * GIB), (1, 6 * GIB)]))
        );
        assert_eq!(
            decide(&snap(&[4, 12]), need(14)),
            Decision::Load(Placement::Spread(vec![(0, 14 * GIB / 4), (1, 14 * GIB * 3 / 4)])),
            "shares follow the room"
        );
        assert_eq!(
            decide(&snap(&[8, 8]), need(20)),
            Decision::NoFit {
                needed: 20 * GIB,
                available: 8 * GIB,
                gpus: vec![(0, 8 * GIB), (1, 8 * GIB)],
                host: 64 * GIB
            }
        );
        let cpu =
            Snapshot { partial_offload: false, gpus: vec![], host_usable: 16 * GIB, runners: vec![], max_loaded: 3 };
        assert_eq!(decide(&cpu, need(10)), Decision::Load(Placement::Cpu));
        assert_eq!(
            decide(&cpu, need(20)),
            Decision::NoFit { needed: 20 * GIB, available: 16 * GIB, gpus: vec![], host: 16 * GIB }
        );
    }

    #[test]
    fn a_model_too_big_for_the_gpus_runs_partly_on_the_cpu_only_when_allowed() {
        // 10 layers of 1 GiB each; GPUs of 3 and 4 GiB take 7 of them, the CPU the rest.
        let need = Need { footprint: Footprint { vram: 10 * GIB, ram: GIB }, layers: 10, per_device: 0 };
        let mut snap = Snapshot {
            partial_offload: true,
            gpus: gpus(&[3, 4]),
            host_usable: 8 * GIB,
            runners: vec![],
            max_loaded: 3,
        };
        assert_eq!(
            decide(&snap, need),
            Decision::Load(Placement::Partial { shares: vec![(1, 4 * GIB), (0, 3 * GIB)], layers: 7, of: 10 })
        );
        // Not enough host memory for the layers left on the CPU.
        snap.host_usable = 3 * GIB;
        assert!(matches!(decide(&snap, need), Decision::NoFit { .. }));
        // Not allowed: the fast failure names every GPU's room and the host's.
        snap.host_usable = 8 * GIB;
        snap.partial_offload = false;
        assert_eq!(
            decide(&snap, need),
            Decision::NoFit {
                needed: 10 * GIB,
                available: 4 * GIB,
                gpus: vec![(0, 3 * GIB), (1, 4 * GIB)],
                host: 8 * GIB
            }
        );
        // Unknown layer count: no partial plan.
        snap.partial_offload = true;
        assert!(matches!(decide(&snap, Need { layers: 0, ..need }), Decision::NoFit { .. }));
        // A partial runner's GPU bytes count on its GPUs.
        let placement = Placement::Partial { shares: vec![(1, 4 * GIB), (0, 3 * GIB)], layers: 7, of: 10 };
        assert_eq!(placement.vram_on(1, 7 * GIB), 4 * GIB);
    }

    #[test]
    fn a_worker_serves_one_runner_at_a_time() {
        // Two devices of worker w, one local GPU; a runner on w's first device.
        let mut gpus = gpus(&[8, 8, 8]);
        gpus[0].worker = Some("w".into());
        gpus[1].worker = Some("w".into());
        let busy = runner(1, Placement::Gpu(0), GIB);
        let snap =
            Snapshot { partial_offload: false, gpus, host_usable: 64 * GIB, runners: vec![busy], max_loaded: 10 };
        assert_eq!(decide(&snap, need(4)), Decision::Load(Placement::Gpu(2)), "not w's other device");
        assert_eq!(decide(&snap, need(12)), Decision::MakeRoom { evict: vec![1], drain: vec![] }, "w frees up");
    }

    #[test]
    fn eviction_takes_idle_runners_shortest_keep_alive_then_least_recently_used() {
        let now = Instant::now() + Duration::from_secs(3600);
        let mut a = runner(1, Placement::Gpu(0), 4 * GIB);
        let mut b = runner(2, Placement::Gpu(0), 4 * GIB);
        let mut c = runner(3, Placement::Gpu(0), 4 * GIB);
        a.last_used = now;
        b.last_used = now.checked_sub(Duration::from_secs(60)).expect("an hour ahead");
        c.keep_alive = KeepAlive::For(Duration::from_secs(10));
        c.last_used = now;
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[12]),
            host_usable: 64 * GIB,
            runners: vec![a, b, c],
            max_loaded: 10,
        };
        assert_eq!(decide(&snap, need(4)), Decision::MakeRoom { evict: vec![3], drain: vec![] }, "shortest keep-alive");
        assert_eq!(
            decide(&snap, need(8)),
            Decision::MakeRoom { evict: vec![3, 2], drain: vec![] },
            "then least recent"
        );
    }

    #[test]
    fn busy_runners_drain_only_when_idle_ones_are_not_enough() {
        let mut busy = runner(1, Placement::Gpu(0), 6 * GIB);
        busy.leases = 2;
        busy.keep_alive = KeepAlive::For(Duration::ZERO);
        let idle = runner(2, Placement::Gpu(0), 2 * GIB);
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[8]),
            host_usable: 64 * GIB,
            runners: vec![busy.clone(), idle],
            max_loaded: 10,
        };
        assert_eq!(decide(&snap, need(2)), Decision::MakeRoom { evict: vec![2], drain: vec![] });
        assert_eq!(decide(&snap, need(7)), Decision::MakeRoom { evict: vec![2], drain: vec![1] });
        // While it drains, the decision is to wait, not to evict again.
        busy.draining = true;
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[8]),
            host_usable: 64 * GIB,
            runners: vec![busy],
            max_loaded: 10,
        };
        assert_eq!(decide(&snap, need(7)), Decision::Wait);
    }

    #[test]
    fn pinned_runners_are_never_evicted() {
        let mut pinned = runner(1, Placement::Gpu(0), 6 * GIB);
        pinned.pinned = true;
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[8]),
            host_usable: 64 * GIB,
            runners: vec![pinned],
            max_loaded: 10,
        };
        assert_eq!(
            decide(&snap, need(4)),
            Decision::NoFit { needed: 4 * GIB, available: 2 * GIB, gpus: vec![(0, 2 * GIB)], host: 64 * GIB }
        );
    }

    #[test]
    fn the_count_limit_evicts_even_when_memory_is_plenty() {
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[80]),
            host_usable: 64 * GIB,
            runners: vec![runner(1, Placement::Gpu(0), GIB), runner(2, Placement::Gpu(0), GIB)],
            max_loaded: 2,
        };
        assert!(matches!(decide(&snap, need(1)), Decision::MakeRoom { ref evict, .. } if evict.len() == 1));
        let mut all_pinned = snap.clone();
        for r in &mut all_pinned.runners {
            r.pinned = true;
        }
        assert_eq!(
            decide(&all_pinned, need(1)),
            Decision::NoFit { needed: GIB, available: 0, gpus: vec![(0, 78 * GIB)], host: 64 * GIB }
        );
    }

    #[test]
    fn a_lower_limit_sheds_idle_runners_first_and_drains_busy_ones_only_when_needed() {
        let now = Instant::now() + Duration::from_secs(3600);
        let mut old = runner(1, Placement::Gpu(0), GIB);
        old.last_used = now.checked_sub(Duration::from_secs(60)).expect("an hour ahead");
        let mut recent = runner(2, Placement::Gpu(0), GIB);
        recent.last_used = now;
        let mut busy = runner(3, Placement::Gpu(0), GIB);
        busy.leases = 1;
        let mut pinned = runner(4, Placement::Gpu(0), GIB);
        pinned.pinned = true;
        let snap = |max_loaded: usize, runners: Vec<RunnerView>| Snapshot {
            partial_offload: false,
            gpus: gpus(&[80]),
            host_usable: 64 * GIB,
            runners,
            max_loaded,
        };
        let all = vec![old.clone(), recent.clone(), busy.clone(), pinned.clone()];
        assert_eq!(shed(&snap(4, all.clone())), None, "within the limit");
        assert_eq!(shed(&snap(3, all.clone())), Some(Decision::MakeRoom { evict: vec![1], drain: vec![] }));
        assert_eq!(shed(&snap(2, all.clone())), Some(Decision::MakeRoom { evict: vec![1, 2], drain: vec![] }));
        assert_eq!(
            shed(&snap(1, all.clone())),
            Some(Decision::MakeRoom { evict: vec![1, 2], drain: vec![3] }),
            "busy ones drain only once the idle ones are not enough; pinned ones stay"
        );
        assert_eq!(shed(&snap(0, all)), Some(Decision::MakeRoom { evict: vec![1, 2], drain: vec![3] }));
        // Runners already leaving count as gone: nothing more is chosen for them.
        let mut leaving = old;
        leaving.draining = true;
        assert_eq!(shed(&snap(3, vec![leaving, recent, busy, pinned])), None);
        // A loading runner is never chosen; nothing else to shed, so nothing is.
        let mut loading = runner(5, Placement::Gpu(0), GIB);
        loading.loading = true;
        let mut pinned2 = runner(6, Placement::Gpu(0), GIB);
        pinned2.pinned = true;
        assert_eq!(shed(&snap(1, vec![loading, pinned2])), None);
    }

    #[test]
    fn loading_runners_count_and_make_us_wait() {
        let mut loading = runner(1, Placement::Gpu(0), 6 * GIB);
        loading.loading = true;
        let snap = Snapshot {
            partial_offload: false,
            gpus: gpus(&[8]),
            host_usable: 64 * GIB,
            runners: vec![loading],
            max_loaded: 10,
        };
        assert_eq!(decide(&snap, need(2)), Decision::Load(Placement::Gpu(0)));
        assert_eq!(decide(&snap, need(4)), Decision::Wait);
    }

    #[test]
    fn host_memory_bounds_gpu_placements_too() {
        let snap =
            Snapshot { partial_offload: false, gpus: gpus(&[8]), host_usable: GIB, runners: vec![], max_loaded: 3 };
        assert_eq!(
            decide(&snap, Footprint { vram: GIB, ram: 2 * GIB }),
            Decision::NoFit { needed: GIB, available: 8 * GIB, gpus: vec![(0, 8 * GIB)], host: GIB }
        );
    }

    fn arbitrary_runner() -> impl Strategy<Value = RunnerView> {
        (0u64..1000, 0usize..3, 1u64..8, 0u32..3, any::<bool>(), 0u64..600).prop_map(
            |(id, gpu, gib, leases, pinned, ka)| {
                let mut r = runner(id, if gpu == 2 { Placement::Cpu } else { Placement::Gpu(gpu) }, gib * GIB);
                r.leases = leases;
                r.pinned = pinned;
                r.keep_alive = KeepAlive::For(Duration::from_secs(ka));
                r
            },
        )
    }

    proptest! {
        /// Whatever the state: a load never over-commits memory or exceeds the count,
        /// and a decision never evicts a pinned, loading or draining runner, nor drains an idle one.
        #[test]
        fn decisions_keep_the_invariants(
            runners in proptest::collection::vec(arbitrary_runner(), 0..8),
            gpu_sizes in proptest::collection::vec(4u64..48, 0..3),
            host in 1u64..64,
            want in 1u64..40,
            max_loaded in 1usize..6,
        ) {
            let mut runners = runners;
            runners.sort_by_key(|r| r.id);
            runners.dedup_by_key(|r| r.id);
            let gpus = gpus(&gpu_sizes);
            let runners: Vec<RunnerView> = runners
                .into_iter()
                .map(|mut r| {
                    if gpus.is_empty() || matches!(r.placement, Placement::Gpu(i) if i >= gpus.len()) { r.placement = Placement::Cpu; }
                    r
                })
                .collect();
            let snap = Snapshot { partial_offload: false, gpus, host_usable: host * GIB, runners, max_loaded };
            let need = Footprint { vram: want * GIB / 2, ram: 0 };
            match decide(&snap, need) {
                Decision::Load(placement) => {
                    prop_assert!(snap.runners.len() < max_loaded);
                    let mut after = snap.clone();
                    after.runners.push(RunnerView { footprint: need, ..runner(u64::MAX, placement.clone(), 0) });
                    for g in &after.gpus {
                        let used: u64 = after.runners.iter().map(|r| r.placement.vram_on(g.index, r.footprint.vram)).sum();
                        let added = after.runners.last().map_or(0, |r| r.placement.vram_on(g.index, r.footprint.vram));
                        // Runners placed before may already over-commit (the generator does not
                        // respect capacity); the new one must not be the cause.
                        prop_assert!(used <= g.usable || added == 0);
                    }
                    if let Placement::Spread(shares) = &placement {
                        prop_assert!(shares.iter().map(|(_, b)| b).sum::<u64>() + shares.len() as u64 >= need.vram);
                    }
                }
                Decision::MakeRoom { evict, drain } => {
                    for id in evict.iter().chain(&drain) {
                        let r = snap.runners.iter().find(|r| r.id == *id).expect("a known runner");
                        prop_assert!(!r.pinned && !r.loading && !r.draining);
                    }
                    for id in &evict {
                        prop_assert!(snap.runners.iter().any(|r| r.id == *id && r.leases == 0));
                    }
                    for id in &drain {
                        prop_assert!(snap.runners.iter().any(|r| r.id == *id && r.leases > 0));
                    }
                    prop_assert!(!evict.is_empty() || !drain.is_empty());
                }
                Decision::Wait => prop_assert!(snap.runners.iter().any(|r| r.draining || r.loading)),
                Decision::NoFit { .. } => {}
            }
        }
    }
}
