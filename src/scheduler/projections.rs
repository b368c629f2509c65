//! llama.cpp's own projection of a load's memory, for the backend: the cache key made of
//! the same values the child's command line is, the cached answer, or a run of
//! `llama-fit-params` (planning) or of llama-server's own dry run (an exact plan).

use std::ffi::OsString;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::backend::{BoxFuture, ProjectedRow, Projecting, Projections};
use crate::projection::{DryRun, Projection, ProjectionCache, ProjectionError, ProjectionKey, Projector};
use crate::store::digest::Digest;
use crate::supervisor::command::{self, FlashAttention, LoadOptions, ModelFiles};
use crate::supervisor::runner::HOST;
use crate::sync::lock;

/// [`Projections`] through a [`Projector`] (planning) and a [`DryRun`] (exact plans),
/// remembered in a [`ProjectionCache`].
#[derive(Debug)]
pub struct CachedProjections {
    projector: Projector,
    dry_run: DryRun,
    cache: Arc<Mutex<ProjectionCache>>,
}

impl CachedProjections {
    /// Projections made by `projector` and `dry_run`, remembered in `cache`.
    #[must_use]
    pub fn new(projector: Projector, dry_run: DryRun, cache: ProjectionCache) -> Self {
        Self { projector, dry_run, cache: Arc::new(Mutex::new(cache)) }
    }
}

impl Projections for CachedProjections {
    fn project(
        &self,
        files: &ModelFiles,
        options: &LoadOptions,
        placement: &command::Placement,
        args: Vec<OsString>,
        env: Vec<(OsString, OsString)>,
        projecting: Projecting,
    ) -> BoxFuture<'static, Result<Vec<ProjectedRow>, String>> {
        let dry_run = matches!(projecting, Projecting::Exact { .. });
        let key = key(files, options, placement, dry_run);
        if let Some(projection) = key.as_ref().and_then(|key| lock(&self.cache).get(key).cloned()) {
            return Box::pin(async move { Ok(rows(&projection, dry_run)) });
        }
        let run: BoxFuture<'static, Result<Projection, ProjectionError>> = match projecting {
            Projecting::Planning => {
                let projector = self.projector.clone();
                Box::pin(async move { projector.project(&args, &env).await })
            }
            Projecting::Exact { runner } => {
                let dry_run = self.dry_run.clone();
                // Each planned device with the name of its buffers, for its compute line.
                let buffers: Vec<(String, String)> = placement
                    .plan
                    .iter()
                    .flat_map(|p| &p.devices)
                    .map(|d| (d.name.clone(), d.buffer.clone()))
                    .collect();
                Box::pin(async move { dry_run.project(&args, &env, runner, &buffers).await })
            }
        };
        let cache = Arc::clone(&self.cache);
        Box::pin(async move {
            let projection = run.await.map_err(|e| e.to_string())?;
            if let Some(key) = key {
                if let Some(write) = lock(&cache).record(key, projection.clone()) {
                    tokio::task::spawn_blocking(move || write.write());
                }
            }
            Ok(rows(&projection, dry_run))
        })
    }
}

/// Each device's bytes, the host's as [`HOST`]. llama.cpp prints model and context in
/// whole MiB, rounded down: half a MiB is added to each device's total (their expected
/// loss, measured on the rig, docs/benchmarks.md).  llama-fit-params prints the compute
/// alike, which gets half a MiB too; a dry run's compute is exact (`dry_run`).
fn rows(projection: &Projection, dry_run: bool) -> Vec<ProjectedRow> {
    let rounding = if dry_run { 0 } else { 1 << 19 };
    let row = |name: &str, usage: crate::projection::Usage| ProjectedRow {
        name: name.to_owned(),
        total: usage.total().saturating_add(1 << 19),
        compute: usage.compute.saturating_add(rounding),
    };
    let mut rows: Vec<ProjectedRow> = projection.devices().iter().map(|d| row(&d.name, d.usage)).collect();
    rows.push(row(HOST, projection.host()));
    rows
}

/// The cache key of a load: the blobs by digest (the store names its files after them)
/// and what of the options and placement shapes memory. `None` for files outside the store.
fn key(
    files: &ModelFiles,
    options: &LoadOptions,
    placement: &command::Placement,
    dry_run: bool,
) -> Option<ProjectionKey> {
    let plan = placement.plan.as_ref();
    let mut devices: Vec<String> =
        placement.devices.iter().map(|d| format!("{}:{}", d.backend.as_str(), d.id)).collect();
    devices.extend(placement.rpc_servers.iter().map(|s| format!("rpc:{s}")));
    devices.extend(plan.into_iter().flat_map(|p| p.devices.iter().map(|d| format!("use:{}", d.name))));
    Some(ProjectionKey {
        model: blob_digest(&files.model)?,
        projector: match &files.projector {
            Some(path) => Some(blob_digest(path)?),
            None => None,
        },
        adapters: files.adapters.iter().map(|a| blob_digest(a)).collect::<Option<_>>()?,
        context: options.num_ctx,
        parallel: options.parallel,
        batch: options.num_batch,
        flash_attention: match options.flash_attention {
            FlashAttention::Auto => None,
            FlashAttention::On => Some(true),
            FlashAttention::Off => Some(false),
        },
        kv_cache_type: options.kv_cache_type.clone(),
        embedding: options.embedding.is_some(),
        devices,
        gpu_layers: options.num_gpu.or_else(|| plan.and_then(|p| p.layers)),
        tensor_split: plan
            .map(|p| p.devices.iter().map(|d| u32::try_from(d.share).unwrap_or(u32::MAX)).collect())
            .unwrap_or_default(),
        dry_run,
    })
}

/// `…/blobs/sha256-<hex>` is the blob `sha256:<hex>`.
fn blob_digest(path: &Path) -> Option<Digest> {
    let name = path.file_name()?.to_str()?;
    Digest::parse(&name.replacen('-', ":", 1)).ok()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::{blob_digest, key};
    use crate::store::digest::Digest;
    use crate::supervisor::command::{DevicePlan, LoadOptions, ModelFiles, Placement, PlannedDevice};

    #[test]
    fn the_key_holds_the_digests_and_what_shapes_memory() {
        let digest = Digest::of(b"weights");
        let blob = PathBuf::from(format!("/var/lib/corral/models/blobs/sha256-{}", digest.hex()));
        assert_eq!(blob_digest(&blob), Some(digest));
        assert_eq!(blob_digest(&PathBuf::from("/tmp/model.gguf")), None, "not a store blob");
        let files = ModelFiles { model: blob, projector: None, adapters: Vec::new() };
        let plan = DevicePlan {
            devices: vec![
                PlannedDevice { name: "RPC0".into(), buffer: "RPC0[a:1]".into(), share: 3 },
                PlannedDevice { name: "RPC1".into(), buffer: "RPC0[b:1]".into(), share: 1 },
            ],
            layers: Some(7),
        };
        let placement =
            Placement { rpc_servers: vec!["a:1".into(), "b:1".into()], plan: Some(plan), ..Placement::default() };
        let options = LoadOptions::default();
        let k = key(&files, &options, &placement, false).expect("a key");
        assert_eq!(k.model, digest);
        assert_eq!(k.gpu_layers, Some(7));
        assert_eq!(k.tensor_split, [3, 1]);
        assert_eq!(k.devices, ["rpc:a:1", "rpc:b:1", "use:RPC0", "use:RPC1"]);
        // Another split is another key.
        let mut other = placement.clone();
        other.plan.as_mut().expect("plan").devices[0].share = 1;
        assert_ne!(key(&files, &options, &other, false), Some(k.clone()));
        // The dry run's projection is another's than llama-fit-params'.
        assert_ne!(key(&files, &options, &placement, true), Some(k));
    }
}
