//! Which requests may share a runner: the [`RunnerKey`], a value compared field by field
//! (never as a formatted string), persisted with the learned footprints.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::store::digest::Digest;
use crate::supervisor::command::LoadOptions;

/// A load's weights: the model's file, its `LoRA` adapters (in the order applied) and its
/// multimodal projector, by digest. A runner of the same weights under another key is
/// replaced when asked for (its load options changed).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    /// The model's weights.
    pub model: Digest,
    /// `LoRA` adapters, in the order they are applied.
    pub adapters: Vec<Digest>,
    /// The multimodal projector, if any.
    pub projector: Option<Digest>,
}

impl Weights {
    /// The weights of a model file alone.
    #[must_use]
    pub fn of(model: Digest) -> Self {
        Self { model, adapters: Vec::new(), projector: None }
    }
}

/// Requests with equal keys share one runner: the same weights and the same load options
/// (any difference needs another llama-server). Sampling options are not part of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunnerKey {
    /// The files.
    pub weights: Weights,
    /// Context length per request slot (`num_ctx`, after the model's cap).
    pub num_ctx: u32,
    /// Request slots.
    pub parallel: u32,
    /// Batch size, or llama.cpp's default.
    pub num_batch: Option<u32>,
    /// Layers on the devices, or llama.cpp's choice.
    pub num_gpu: Option<u32>,
    /// The GPU of a single-device load.
    pub main_gpu: Option<u32>,
    /// Whether the weights are mapped, or llama.cpp's default.
    pub use_mmap: Option<bool>,
    /// Generation threads, or llama.cpp's default.
    pub num_thread: Option<u32>,
}

impl RunnerKey {
    /// The key of `weights` loaded with `options`.
    #[must_use]
    pub fn new(weights: Weights, options: &LoadOptions) -> Self {
        Self {
            weights,
            num_ctx: options.num_ctx,
            parallel: options.parallel,
            num_batch: options.num_batch,
            num_gpu: options.num_gpu,
            main_gpu: options.main_gpu,
            use_mmap: options.use_mmap,
            num_thread: options.num_thread,
        }
    }
}

/// For logs: `sha256:0123456789ab+lora:…+mmproj:… ctx=4096 np=1` and each option set.
impl fmt::Display for RunnerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = |d: &Digest| d.hex()[..12].to_owned();
        write!(f, "sha256:{}", short(&self.weights.model))?;
        for adapter in &self.weights.adapters {
            write!(f, "+lora:{}", short(adapter))?;
        }
        if let Some(projector) = &self.weights.projector {
            write!(f, "+mmproj:{}", short(projector))?;
        }
        write!(f, " ctx={} np={}", self.num_ctx, self.parallel)?;
        let options = [
            ("batch", self.num_batch.map(|n| n.to_string())),
            ("ngl", self.num_gpu.map(|n| n.to_string())),
            ("mg", self.main_gpu.map(|n| n.to_string())),
            ("mmap", self.use_mmap.map(|b| b.to_string())),
            ("threads", self.num_thread.map(|n| n.to_string())),
        ];
        for (name, value) in options {
            if let Some(value) = value {
                write!(f, " {name}={value}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{RunnerKey, Weights};
    use crate::store::digest::Digest;
    use crate::supervisor::command::LoadOptions;

    fn key(model: &str) -> RunnerKey {
        RunnerKey::new(Weights::of(Digest::of(model.as_bytes())), &LoadOptions::default())
    }

    #[test]
    fn keys_are_equal_by_value_ordered_and_each_field_makes_another_key() {
        let k = key("m");
        assert_eq!(k, key("m"), "the same weights and options");
        assert_eq!(k.cmp(&key("m")), std::cmp::Ordering::Equal);
        let variants = [
            k.clone(),
            key("other"),
            RunnerKey { weights: Weights { adapters: vec![Digest::of(b"lora")], ..k.weights.clone() }, ..k.clone() },
            RunnerKey { weights: Weights { projector: Some(Digest::of(b"mmproj")), ..k.weights.clone() }, ..k.clone() },
            RunnerKey { num_ctx: 8192, ..k.clone() },
            RunnerKey { parallel: 2, ..k.clone() },
            RunnerKey { num_batch: Some(512), ..k.clone() },
            RunnerKey { num_gpu: Some(0), ..k.clone() },
            RunnerKey { main_gpu: Some(1), ..k.clone() },
            RunnerKey { use_mmap: Some(false), ..k.clone() },
            RunnerKey { num_thread: Some(4), ..k.clone() },
        ];
        let distinct: BTreeSet<&RunnerKey> = variants.iter().collect();
        assert_eq!(distinct.len(), variants.len(), "every field tells keys apart");
        let hashed: std::collections::HashSet<&RunnerKey> = variants.iter().collect();
        assert_eq!(hashed.len(), variants.len());
        // Ordered by the weights first, then the options: a total order, stable across runs.
        assert!(RunnerKey { num_ctx: 1, ..k.clone() } < RunnerKey { num_ctx: 2, ..k.clone() });
        let mut sorted = variants.to_vec();
        sorted.sort();
        sorted.reverse();
        sorted.sort();
        assert_eq!(sorted.iter().collect::<BTreeSet<_>>(), distinct);
        let json = serde_json::to_string(&k).expect("json");
        assert_eq!(serde_json::from_str::<RunnerKey>(&json).expect("read back"), k);
    }

    #[test]
    fn a_key_shows_briefly_in_logs() {
        let k = RunnerKey {
            weights: Weights {
                model: Digest::of(b"m"),
                adapters: vec![Digest::of(b"a")],
                projector: Some(Digest::of(b"p")),
            },
            num_gpu: Some(0),
            ..key("m")
        };
        let shown = k.to_string();
        assert!(shown.starts_with(&format!("sha256:{}+lora:", &Digest::of(b"m").hex()[..12])), "{shown}");
        assert!(shown.contains("+mmproj:") && shown.ends_with(" ctx=4096 np=1 ngl=0"), "{shown}");
    }
}
