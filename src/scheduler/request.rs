//! From a model name and a client's options to what the scheduler needs: the files,
//! the load options (model defaults, then the client's), the memory estimate and the
//! key that says which requests may share a runner.
//!
//! Only load-time options take part in the key; sampling options (temperature, stop,
//! …) never cause a reload.

use serde_json::{Map, Value};

use super::actor::ModelRequest;
use super::keep_alive::KeepAlive;
use super::policy::{self, Footprint};
use crate::gguf::metadata::PoolingType;
use crate::store::name::ModelName;
use crate::store::show::ModelDetails;
use crate::store::{Store, StoreError};
use crate::supervisor::command::{LoadOptions, ModelFiles, Pooling};

/// Defaults that come from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    /// `num_ctx` when neither the model nor the client sets it.
    pub num_ctx: u32,
    /// Request slots per runner.
    pub parallel: u32,
}

/// Why a request cannot be turned into a load.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The model is not in the store, or its files are unreadable.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An option has the wrong type or value.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// The option.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

/// Builds the scheduler's request for model `name` with the client's `options`.
pub fn build(
    store: &Store,
    name: &ModelName,
    options: &Map<String, Value>,
    keep_alive: Option<KeepAlive>,
    pinned: bool,
    defaults: Defaults,
) -> Result<ModelRequest, RequestError> {
    let shown = store.details(name)?;
    from_details(store, &shown, options, keep_alive, pinned, defaults)
}

/// [`build`] for a model whose details the caller already read (it needs them too: a
/// model's default system prompt and parameters), so the store is read once.
pub fn from_details(
    store: &Store,
    shown: &ModelDetails,
    options: &Map<String, Value>,
    keep_alive: Option<KeepAlive>,
    pinned: bool,
    defaults: Defaults,
) -> Result<ModelRequest, RequestError> {
    let name = &shown.name;
    let manifest = &shown.manifest;
    let weights = manifest.model().expect("a parsed manifest has weights");
    let projector = manifest.layers_of(crate::store::manifest::PROJECTOR).next();
    let adapters: Vec<_> = manifest.layers_of(crate::store::manifest::ADAPTER).collect();

    // The model's own parameters first, the client's over them.
    let mut merged: Map<String, Value> = shown.parameters.clone().into_iter().collect();
    merged.extend(options.clone());
    let mut load =
        LoadOptions { num_ctx: defaults.num_ctx, parallel: defaults.parallel.max(1), ..LoadOptions::default() };
    if let Some(n) = uint(&merged, "num_ctx")? {
        load.num_ctx = n.max(4);
    }
    if let Some(train) = shown.info.context_length {
        load.num_ctx = load.num_ctx.min(u32::try_from(train).unwrap_or(u32::MAX));
    }
    load.num_batch = uint(&merged, "num_batch")?;
    load.num_thread = uint(&merged, "num_thread")?.filter(|n| *n > 0);
    load.main_gpu = uint(&merged, "main_gpu")?;
    // A negative num_gpu (Ollama's -1) means "let llama.cpp decide", like an unset one.
    load.num_gpu = match merged.get("num_gpu") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(n) if n < 0 => None,
            Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
            None => return Err(invalid("num_gpu", "expected an integer")),
        },
    };
    load.use_mmap = match merged.get("use_mmap") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err(invalid("use_mmap", "expected true or false")),
    };
    if let Some(pooling) = shown.info.pooling_type {
        load.embedding = Some(match pooling {
            PoolingType::Mean => Pooling::Mean,
            _ => Pooling::ModelDefault,
        });
    }

    let kv = shown.info.kv_cache_bytes(u64::from(load.num_ctx), u64::from(load.parallel));
    let need: Footprint = policy::estimate(weights.size, kv, projector.map_or(0, |p| p.size));
    let files = ModelFiles {
        // Checked to be files of the store, not links planted there (the store never follows one).
        model: store.blob_file(&weights.digest)?,
        projector: projector.map(|p| store.blob_file(&p.digest)).transpose()?,
        adapters: adapters.iter().map(|a| store.blob_file(&a.digest)).collect::<Result<_, _>>()?,
    };
    let mut weights_id = weights.digest.hex();
    for adapter in &adapters {
        weights_id.push('+');
        weights_id.push_str(&adapter.digest.hex());
    }
    if let Some(p) = projector {
        weights_id.push_str("+mmproj:");
        weights_id.push_str(&p.digest.hex());
    }
    let key = format!(
        "{weights_id}|ctx={}|np={}|batch={:?}|ngl={:?}|mg={:?}|mmap={:?}|threads={:?}",
        load.num_ctx, load.parallel, load.num_batch, load.num_gpu, load.main_gpu, load.use_mmap, load.num_thread
    );
    Ok(ModelRequest {
        key,
        weights: weights_id,
        name: name.to_string(),
        files,
        options: load,
        need,
        // The blocks and the output layer, as llama.cpp counts them for `-ngl`.
        layers: shown.info.block_count.map_or(0, |n| u32::try_from(n.saturating_add(1)).unwrap_or(u32::MAX)),
        keep_alive,
        pinned,
    })
}

fn invalid(name: &str, reason: &str) -> RequestError {
    RequestError::InvalidOption { name: name.to_owned(), reason: reason.to_owned() }
}

fn uint(options: &Map<String, Value>, name: &str) -> Result<Option<u32>, RequestError> {
    match options.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| invalid(name, "expected a non-negative integer")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value, json};

    use super::{Defaults, build};
    use crate::store::Store;
    use crate::store::create::CreateSpec;
    use crate::store::modelfile::Modelfile;
    use crate::store::name::ModelName;
    use crate::supervisor::command::Pooling;

    const DEFAULTS: Defaults = Defaults { num_ctx: 4096, parallel: 1 };

    fn store_with(modelfile: &str) -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("store")).expect("open");
        crate::demo_model::write_tiny_llama(&dir.path().join("tiny.gguf")).expect("llama");
        crate::demo_model::write_tiny_bert(&dir.path().join("bert.gguf")).expect("bert");
        let spec =
            CreateSpec::from_modelfile(&Modelfile::parse(modelfile).expect("modelfile"), dir.path()).expect("spec");
        store.create(&ModelName::parse("m").expect("name"), &spec, &mut |_| {}).expect("create");
        (dir, store)
    }

    fn options(v: &Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn options_come_from_the_model_then_the_client_and_the_context_is_capped() {
        let (_dir, store) = store_with("FROM ./tiny.gguf\nPARAMETER num_ctx 1024\nPARAMETER temperature 0.1\n");
        let name = ModelName::parse("m").expect("name");
        let r = build(&store, &name, &Map::new(), None, false, DEFAULTS).expect("build");
        assert_eq!(r.options.num_ctx, 1024, "the model's parameter");
        assert_eq!(r.name, "m:latest");
        assert!(r.files.model.starts_with(store.blobs_dir()));
        let r = build(&store, &name, &options(&json!({"num_ctx": 999_999, "num_gpu": -1})), None, false, DEFAULTS)
            .expect("build");
        assert_eq!(r.options.num_ctx, 2048, "capped at the trained context");
        assert_eq!(r.options.num_gpu, None, "-1 lets llama.cpp decide");
        let hot = build(&store, &name, &options(&json!({"temperature": 1.5, "seed": 3})), None, false, DEFAULTS)
            .expect("build");
        let base = build(&store, &name, &Map::new(), None, false, DEFAULTS).expect("build");
        assert_eq!(hot.key, base.key, "sampling options share the runner");
        let bigger = build(&store, &name, &options(&json!({"num_ctx": 512})), None, false, DEFAULTS).expect("build");
        assert_ne!(bigger.key, base.key, "a load option needs another runner");
        assert_eq!(bigger.weights, base.weights, "of the same weights");
        assert!(bigger.need.vram < base.need.vram, "a smaller context needs less");
    }

    #[test]
    fn embedding_models_are_served_as_such() {
        let (_dir, store) = store_with("FROM ./bert.gguf\n");
        let r =
            build(&store, &ModelName::parse("m").expect("name"), &Map::new(), None, false, DEFAULTS).expect("build");
        assert_eq!(r.options.embedding, Some(Pooling::Mean));
    }

    #[test]
    fn wrong_option_types_are_named() {
        let (_dir, store) = store_with("FROM ./tiny.gguf\n");
        let name = ModelName::parse("m").expect("name");
        for (opts, message) in [
            (json!({"num_ctx": "big"}), "invalid option num_ctx: expected a non-negative integer"),
            (json!({"num_ctx": -5}), "invalid option num_ctx"),
            (json!({"num_gpu": "all"}), "invalid option num_gpu: expected an integer"),
            (json!({"use_mmap": 1}), "invalid option use_mmap: expected true or false"),
        ] {
            let err = build(&store, &name, &options(&opts), None, false, DEFAULTS).expect_err("bad").to_string();
            assert!(err.contains(message), "{opts}: {err}");
        }
        let missing = build(&store, &ModelName::parse("nope").expect("name"), &Map::new(), None, false, DEFAULTS);
        assert_eq!(missing.expect_err("missing").to_string(), "model 'nope:latest' not found");
    }
}
