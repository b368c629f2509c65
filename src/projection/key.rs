//! What decides a projection: the cache's key, a value rather than a formatted string.

use serde::{Deserialize, Serialize};

use crate::store::digest::Digest;

/// Everything llama.cpp's projection depends on: the files (by digest), the load options
/// that shape memory, and the placement.  Two loads with equal keys get the same
/// projection from the same llama.cpp build; a field that does not change memory (threads,
/// the socket, the alias) does not belong here.
///
/// Kept a plain struct with public fields: the scheduler fills it from the same values it
/// builds the child's command line from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectionKey {
    /// The model's weights.
    pub model: Digest,
    /// The multimodal projector, if the load has one.
    pub projector: Option<Digest>,
    /// `LoRA` adapters, in the order they are applied.
    pub adapters: Vec<Digest>,
    /// Context length per request slot.
    pub context: u32,
    /// Request slots (`-np`).
    pub parallel: u32,
    /// Batch size (`-b`/`-ub`), or llama.cpp's default.
    pub batch: Option<u32>,
    /// Flash attention: `Some(true)` on, `Some(false)` off, `None` llama.cpp's choice.
    pub flash_attention: Option<bool>,
    /// KV cache type (`f16`, `q8_0`, …), or llama.cpp's default.
    pub kv_cache_type: Option<String>,
    /// Embeddings only (no generation buffers).
    pub embedding: bool,
    /// The devices the child may use, by stable id (`cuda:GPU-…`, `rpc:127.0.0.1:50052#0`),
    /// in the order they are given to llama.cpp; empty for the CPU alone.
    pub devices: Vec<String>,
    /// Layers on the devices (`-ngl`), or llama.cpp's own choice.
    pub gpu_layers: Option<u32>,
    /// The split between the devices (`-ts`), empty for llama.cpp's default.
    pub tensor_split: Vec<u32>,
    /// Projected by llama-server's own dry run with the child's arguments (an exact
    /// plan's), rather than by llama-fit-params (the scheduler's planning).
    pub dry_run: bool,
}

/// A key for tests: the weights `sha256("weights")` with context `context` on a worker
/// and a GPU.
#[cfg(test)]
pub(crate) fn key(context: u32) -> ProjectionKey {
    use crate::store::digest::Digest;
    ProjectionKey {
        model: Digest::of(b"weights"),
        projector: None,
        adapters: Vec::new(),
        context,
        parallel: 1,
        batch: None,
        flash_attention: None,
        kv_cache_type: None,
        embedding: false,
        devices: vec!["rpc:127.0.0.1:50052#0".into(), "cuda:GPU-1234".into()],
        gpu_layers: Some(99),
        tensor_split: vec![1, 1],
        dry_run: false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{ProjectionKey, key};
    use crate::store::digest::Digest;

    #[test]
    fn a_key_reads_back_from_json_and_each_field_makes_a_different_key() {
        let k = key(4096);
        let json = serde_json::to_string(&k).expect("json");
        assert!(json.contains("\"model\":\"sha256:"), "{json}");
        assert_eq!(serde_json::from_str::<ProjectionKey>(&json).expect("read back"), k);
        let variants = [
            k.clone(),
            key(8192),
            ProjectionKey { projector: Some(Digest::of(b"mmproj")), ..k.clone() },
            ProjectionKey { adapters: vec![Digest::of(b"lora")], ..k.clone() },
            ProjectionKey { parallel: 2, ..k.clone() },
            ProjectionKey { batch: Some(512), ..k.clone() },
            ProjectionKey { flash_attention: Some(false), ..k.clone() },
            ProjectionKey { kv_cache_type: Some("q8_0".into()), ..k.clone() },
            ProjectionKey { embedding: true, ..k.clone() },
            ProjectionKey { devices: vec!["rpc:127.0.0.1:50052#0".into()], ..k.clone() },
            ProjectionKey { gpu_layers: None, ..k.clone() },
            ProjectionKey { tensor_split: vec![3, 1], ..k.clone() },
            ProjectionKey { dry_run: true, ..k.clone() },
        ];
        assert_eq!(variants.iter().collect::<BTreeSet<_>>().len(), variants.len());
        assert!(serde_json::from_str::<ProjectionKey>(&json.replace("\"embedding\"", "\"embed\"")).is_err());
    }
}
