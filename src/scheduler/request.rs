//! From a model name and a client's options to what the scheduler needs: the files,
//! the load options (model defaults, then the client's), the memory estimate and the
//! key that says which requests may share a runner.
//!
//! Load options are parsed once, here ([`LoadOverrides::parse`]), from any
//! [`OptionSource`]: the JSON adapter (HTTP bodies, a model's parameters) and the D-Bus
//! `a{sv}` adapter (`dbus::options`) only bring their values to [`OptionValue`], so both
//! views accept the same values and name the same problems.
//!
//! Only load-time options take part in the key; sampling options (temperature, stop,
//! …) never cause a reload.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::keep_alive::{InvalidKeepAlive, KeepAlive};
use super::key::{RunnerKey, Weights};
use super::policy::{self, Footprint};
use super::types::ModelRequest;
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
    /// The keep-alive cannot be used.
    #[error(transparent)]
    KeepAlive(#[from] InvalidKeepAlive),
}

/// One option's value as a source holds it, in the terms the rules are written in: both
/// adapters (JSON, D-Bus `a{sv}`) bring their values to this, and [`LoadOverrides::parse`]
/// alone decides what each option accepts.
#[derive(Debug, Clone, PartialEq)]
pub enum OptionValue {
    /// A boolean.
    Bool(bool),
    /// A whole number (JSON integers, D-Bus `y n q i u x t`).
    Integer(i128),
    /// A number with a fraction or exponent (JSON floats, D-Bus `d`).
    Float(f64),
    /// A string.
    Text(String),
    /// Anything else (an array, an object), by what the source calls its type.
    Other(String),
}

impl OptionValue {
    /// The value as JSON, for the parsers that read JSON (the keep-alive's).
    fn to_json(&self) -> Value {
        match self {
            Self::Bool(b) => Value::Bool(*b),
            Self::Integer(n) => i64::try_from(*n)
                .map(Value::from)
                .or_else(|_| u64::try_from(*n).map(Value::from))
                // Sources give integers of at most 64 bits.
                .unwrap_or(Value::Null),
            Self::Float(x) => serde_json::Number::from_f64(*x).map_or(Value::Null, Value::Number),
            Self::Text(s) => Value::String(s.clone()),
            Self::Other(kind) => Value::String(format!("<{kind}>")),
        }
    }
}

/// Where options come from: an HTTP body's `options` or a model's parameters (JSON
/// objects), or a D-Bus call's `a{sv}`.
pub trait OptionSource {
    /// The value of `key`; `None` when it is absent (or JSON's `null`, which means the same).
    fn option(&self, key: &str) -> Option<OptionValue>;
}

/// A JSON value as an option's value.
#[must_use]
pub fn json_option(value: &Value) -> Option<OptionValue> {
    Some(match value {
        Value::Null => return None,
        Value::Bool(b) => OptionValue::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => OptionValue::Integer(i128::from(i)),
            (None, Some(u)) => OptionValue::Integer(i128::from(u)),
            (None, None) => OptionValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => OptionValue::Text(s.clone()),
        Value::Array(_) => OptionValue::Other("an array".into()),
        Value::Object(_) => OptionValue::Other("an object".into()),
    })
}

/// The JSON adapter: an HTTP body (its `options`, or the body itself for `keep_alive`).
impl OptionSource for Map<String, Value> {
    fn option(&self, key: &str) -> Option<OptionValue> {
        self.get(key).and_then(json_option)
    }
}

/// The JSON adapter for a model's parameters (from its Modelfile).
impl OptionSource for BTreeMap<String, Value> {
    fn option(&self, key: &str) -> Option<OptionValue> {
        self.get(key).and_then(json_option)
    }
}

/// `num_gpu` as Ollama takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    /// A negative number (Ollama's `-1`): llama.cpp decides, as when it is not set.
    Auto,
    /// This many layers on the devices (0: none).
    Layers(u32),
}

/// The load options a client (or a model's parameters) may set, typed: each `None` when
/// not given. Sampling options are not here; they never need another runner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOverrides {
    /// Context length per request slot; at least 4, at most the model's trained context.
    pub num_ctx: Option<u32>,
    /// Batch size.
    pub num_batch: Option<u32>,
    /// Generation threads; 0 means llama.cpp's default.
    pub num_thread: Option<u32>,
    /// Layers on the devices.
    pub num_gpu: Option<GpuLayers>,
    /// The GPU of a single-device load.
    pub main_gpu: Option<u32>,
    /// Whether to map the weights.
    pub use_mmap: Option<bool>,
}

/// The option keys [`LoadOverrides::parse`] reads.
pub const LOAD_OPTIONS: [&str; 6] = ["num_ctx", "num_batch", "num_thread", "num_gpu", "main_gpu", "use_mmap"];

impl LoadOverrides {
    /// The one parser of load options, whatever their source: every rule (types, ranges,
    /// the error naming the key) is here. Keys it does not know are left alone (an HTTP
    /// body's sampling options).
    pub fn parse(source: &(impl OptionSource + ?Sized)) -> Result<Self, RequestError> {
        Ok(Self {
            num_ctx: uint(source, "num_ctx", LLAMA_INT_MAX)?,
            num_batch: uint(source, "num_batch", LLAMA_INT_MAX)?,
            num_thread: uint(source, "num_thread", THREADS_MAX)?,
            num_gpu: match source.option("num_gpu") {
                None => None,
                Some(OptionValue::Integer(n)) if n < 0 => Some(GpuLayers::Auto),
                Some(OptionValue::Integer(n)) => Some(GpuLayers::Layers(u32::try_from(n).unwrap_or(u32::MAX))),
                Some(_) => return Err(invalid("num_gpu", "expected an integer")),
            },
            main_gpu: uint(source, "main_gpu", LLAMA_INT_MAX)?,
            use_mmap: match source.option("use_mmap") {
                None => None,
                Some(OptionValue::Bool(b)) => Some(b),
                Some(_) => return Err(invalid("use_mmap", "expected true or false")),
            },
        })
    }

    /// These options over `base`: each one given here wins, the others come from `base`
    /// (the client's options over the model's parameters).
    #[must_use]
    pub fn over(self, base: Self) -> Self {
        Self {
            num_ctx: self.num_ctx.or(base.num_ctx),
            num_batch: self.num_batch.or(base.num_batch),
            num_thread: self.num_thread.or(base.num_thread),
            num_gpu: self.num_gpu.or(base.num_gpu),
            main_gpu: self.main_gpu.or(base.main_gpu),
            use_mmap: self.use_mmap.or(base.use_mmap),
        }
    }
}

impl LoadOverrides {
    /// Whether option `key` is given here.
    fn gives(&self, key: &str) -> bool {
        match key {
            "num_ctx" => self.num_ctx.is_some(),
            "num_batch" => self.num_batch.is_some(),
            "num_thread" => self.num_thread.is_some(),
            "num_gpu" => self.num_gpu.is_some(),
            "main_gpu" => self.main_gpu.is_some(),
            "use_mmap" => self.use_mmap.is_some(),
            _ => false,
        }
    }
}

/// The options of `source` that `over` does not give: a model's parameters under the
/// client's options, so that a parameter the client overrides is never read (nor refused).
struct Under<'a, S: ?Sized> {
    source: &'a S,
    over: &'a LoadOverrides,
}

impl<S: OptionSource + ?Sized> OptionSource for Under<'_, S> {
    fn option(&self, key: &str) -> Option<OptionValue> {
        if self.over.gives(key) { None } else { self.source.option(key) }
    }
}

/// The keep-alive under `key` (Ollama's forms: a Go duration string, or seconds), with the
/// same rules for every source; `None` when absent.
pub fn keep_alive(source: &(impl OptionSource + ?Sized), key: &str) -> Result<Option<KeepAlive>, RequestError> {
    match source.option(key) {
        None => Ok(None),
        Some(OptionValue::Other(kind)) => Err(InvalidKeepAlive {
            value: kind,
            reason: "expected a duration string like \"5m\" or a number of seconds",
        }
        .into()),
        Some(value) => Ok(KeepAlive::from_json(Some(&value.to_json()))?),
    }
}

/// An embedding model's `num_batch` (and physical batch) when neither the model nor the
/// client sets one, if its context is no smaller: the longest input it embeds, in tokens.
pub const EMBEDDING_BATCH: u32 = 2048;

/// Builds the scheduler's request for model `name` with the client's load `options`.
pub fn build(
    store: &Store,
    name: &ModelName,
    options: &LoadOverrides,
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
    options: &LoadOverrides,
    keep_alive: Option<KeepAlive>,
    pinned: bool,
    defaults: Defaults,
) -> Result<ModelRequest, RequestError> {
    let name = &shown.name;
    let manifest = &shown.manifest;
    let weights = manifest.model();
    let projector = manifest.layers_of(crate::store::manifest::PROJECTOR).next();
    let adapters: Vec<_> = manifest.layers_of(crate::store::manifest::ADAPTER).collect();

    // The model's own parameters first, the client's over them.
    let merged = options.over(LoadOverrides::parse(&Under { source: &shown.parameters, over: options })?);
    let mut load =
        LoadOptions { num_ctx: defaults.num_ctx, parallel: defaults.parallel.max(1), ..LoadOptions::default() };
    if let Some(n) = merged.num_ctx {
        load.num_ctx = n.max(4);
    }
    if let Some(train) = shown.info.context_length {
        load.num_ctx = load.num_ctx.min(u32::try_from(train).unwrap_or(u32::MAX));
    }
    load.num_batch = merged.num_batch;
    load.num_thread = merged.num_thread.filter(|n| *n > 0);
    load.main_gpu = merged.main_gpu;
    load.num_gpu = match merged.num_gpu {
        None | Some(GpuLayers::Auto) => None,
        Some(GpuLayers::Layers(n)) => Some(n),
    };
    load.use_mmap = merged.use_mmap;
    if let Some(pooling) = shown.info.pooling_type {
        load.embedding = Some(match pooling {
            PoolingType::Mean => Pooling::Mean,
            _ => Pooling::ModelDefault,
        });
        // llama-server embeds an input in one physical batch (512 tokens unless set), so
        // without this a longer input fails however large the context: Ollama's default.
        load.num_batch = load.num_batch.or(Some(load.num_ctx.min(EMBEDDING_BATCH)));
    }

    let kv = shown.info.kv_cache_bytes(u64::from(load.num_ctx), u64::from(load.parallel));
    let need: Footprint = policy::estimate(weights.size, kv, projector.map_or(0, |p| p.size));
    let files = ModelFiles {
        // Checked to be files of the store, not links planted there (the store never follows one).
        model: store.blob_file(&weights.digest)?,
        projector: projector.map(|p| store.blob_file(&p.digest)).transpose()?,
        adapters: adapters.iter().map(|a| store.blob_file(&a.digest)).collect::<Result<_, _>>()?,
    };
    let weights_id = Weights {
        model: weights.digest,
        adapters: adapters.iter().map(|a| a.digest).collect(),
        projector: projector.map(|p| p.digest),
    };
    Ok(ModelRequest {
        key: RunnerKey::new(weights_id, &load),
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

/// The most llama-server's command line takes for an integer option (a C `int`): more is
/// its parse error, a failed load, rather than the client's 400.
const LLAMA_INT_MAX: u32 = i32::MAX.unsigned_abs();

/// The most threads a runner is given: ggml's `GGML_MAX_N_THREADS`. llama-server starts a
/// thread for each asked (100 000 crashed it), and no machine it runs on has more cores.
const THREADS_MAX: u32 = 512;

fn uint(source: &(impl OptionSource + ?Sized), name: &str, max: u32) -> Result<Option<u32>, RequestError> {
    match source.option(name) {
        None => Ok(None),
        Some(OptionValue::Integer(n)) if n < 0 => Err(invalid(name, "expected a non-negative integer")),
        Some(OptionValue::Integer(n)) => u32::try_from(n)
            .ok()
            .filter(|n| *n <= max)
            .map(Some)
            .ok_or_else(|| invalid(name, &format!("expected a non-negative integer (at most {max})"))),
        Some(_) => Err(invalid(name, "expected a non-negative integer")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{Map, Value, json};

    use super::{Defaults, GpuLayers, LoadOverrides, build, keep_alive};
    use crate::scheduler::keep_alive::KeepAlive;
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

    fn map(v: &Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    fn options(v: &Value) -> LoadOverrides {
        LoadOverrides::parse(&map(v)).expect("valid options")
    }

    #[test]
    fn options_come_from_the_model_then_the_client_and_the_context_is_capped() {
        let (_dir, store) =
            store_with("FROM ./tiny.gguf\nPARAMETER num_ctx 1024\nPARAMETER num_gpu 3\nPARAMETER temperature 0.1\n");
        let name = ModelName::parse("m").expect("name");
        let none = LoadOverrides::default();
        let r = build(&store, &name, &none, None, false, DEFAULTS).expect("build");
        assert_eq!(r.options.num_ctx, 1024, "the model's parameter");
        assert_eq!(r.options.num_gpu, Some(3), "the model's parameter");
        assert_eq!(r.name, "m:latest");
        assert!(r.files.model.starts_with(store.blobs_dir()));
        let r = build(&store, &name, &options(&json!({"num_ctx": 999_999, "num_gpu": -1})), None, false, DEFAULTS)
            .expect("build");
        assert_eq!(r.options.num_ctx, 2048, "capped at the trained context");
        assert_eq!(r.options.num_gpu, None, "the client's -1 lets llama.cpp decide, over the model's 3");
        let hot = build(&store, &name, &options(&json!({"temperature": 1.5, "seed": 3})), None, false, DEFAULTS)
            .expect("build");
        let base = build(&store, &name, &none, None, false, DEFAULTS).expect("build");
        assert_eq!(hot.key, base.key, "sampling options share the runner");
        let bigger = build(&store, &name, &options(&json!({"num_ctx": 512})), None, false, DEFAULTS).expect("build");
        assert_ne!(bigger.key, base.key, "a load option needs another runner");
        assert_eq!(bigger.key.weights, base.key.weights, "of the same weights");
        assert_eq!(bigger.key.num_ctx, 512);
        assert!(bigger.need.vram < base.need.vram, "a smaller context needs less");
        // null is not given: the model's parameter stays; a thread count of 0 is the default.
        let r = build(&store, &name, &options(&json!({"num_ctx": null, "num_thread": 0})), None, false, DEFAULTS)
            .expect("build");
        assert_eq!((r.options.num_ctx, r.options.num_thread), (1024, None));
    }

    #[test]
    fn embedding_models_are_served_as_such() {
        let (_dir, store) = store_with("FROM ./bert.gguf\n");
        let name = ModelName::parse("m").expect("name");
        let r = build(&store, &name, &LoadOverrides::default(), None, false, DEFAULTS).expect("build");
        assert_eq!(r.options.embedding, Some(Pooling::Mean));
        // The tiny bert's context is 512 tokens: an input of all of it fits one batch.
        assert_eq!((r.options.num_ctx, r.options.num_batch), (512, Some(512)));
        let small = build(&store, &name, &options(&json!({"num_ctx": 100})), None, false, DEFAULTS).expect("build");
        assert_eq!(small.options.num_batch, Some(100), "the batch follows the context");
        let set = build(&store, &name, &options(&json!({"num_batch": 64})), None, false, DEFAULTS).expect("build");
        assert_eq!(set.options.num_batch, Some(64), "the client's batch wins");
        let (_dir, store) = store_with("FROM ./tiny.gguf\n");
        let chat = build(&store, &name, &LoadOverrides::default(), None, false, DEFAULTS).expect("build");
        assert_eq!(chat.options.num_batch, None, "llama-server's own for a generating model");
    }

    #[test]
    fn every_load_option_is_read_and_the_clients_win() {
        let client = options(&json!({
            "num_ctx": 2048, "num_batch": 256, "num_thread": 6, "num_gpu": 12, "main_gpu": 1, "use_mmap": false,
            "temperature": 0.3
        }));
        assert_eq!(
            client,
            LoadOverrides {
                num_ctx: Some(2048),
                num_batch: Some(256),
                num_thread: Some(6),
                num_gpu: Some(GpuLayers::Layers(12)),
                main_gpu: Some(1),
                use_mmap: Some(false),
            }
        );
        let model = options(&json!({"num_ctx": 1024, "num_gpu": 2, "num_batch": 64}));
        let merged = options(&json!({"num_gpu": -5})).over(model);
        assert_eq!(merged.num_ctx, Some(1024));
        assert_eq!(merged.num_batch, Some(64));
        assert_eq!(merged.num_gpu, Some(GpuLayers::Auto));
        assert_eq!(options(&json!({"num_gpu": 1_u64 << 40})).num_gpu, Some(GpuLayers::Layers(u32::MAX)));
        let most =
            options(&json!({"num_ctx": i32::MAX, "num_batch": i32::MAX, "num_thread": 512, "main_gpu": i32::MAX}));
        assert_eq!((most.num_ctx, most.num_thread), (Some(i32::MAX.unsigned_abs()), Some(512)));
    }

    #[test]
    fn a_models_parameter_the_client_overrides_is_never_read() {
        let model: std::collections::BTreeMap<String, Value> =
            [("num_ctx".to_owned(), json!("big")), ("num_batch".to_owned(), json!(64))].into_iter().collect();
        let client = options(&json!({"num_ctx": 1024}));
        let under = LoadOverrides::parse(&super::Under { source: &model, over: &client }).expect("num_ctx not read");
        assert_eq!(client.over(under), LoadOverrides { num_ctx: Some(1024), num_batch: Some(64), ..client });
        let err = LoadOverrides::parse(&super::Under { source: &model, over: &LoadOverrides::default() })
            .expect_err("the model's own bad value");
        assert_eq!(err.to_string(), "invalid option num_ctx: expected a non-negative integer");
        for key in super::LOAD_OPTIONS {
            let every = options(&json!({
                "num_ctx": 1, "num_batch": 1, "num_thread": 1, "num_gpu": 1, "main_gpu": 1, "use_mmap": true
            }));
            assert!(every.gives(key) && !LoadOverrides::default().gives(key), "{key}");
        }
    }

    #[test]
    fn wrong_option_types_are_named() {
        for (opts, message) in [
            (json!({"num_ctx": "big"}), "invalid option num_ctx: expected a non-negative integer"),
            (json!({"num_ctx": -5}), "invalid option num_ctx: expected a non-negative integer"),
            (json!({"num_ctx": 4096.0}), "invalid option num_ctx: expected a non-negative integer"),
            (json!({"num_batch": 1_u64 << 33}), "invalid option num_batch: expected a non-negative integer (at most"),
            // What llama-server's command line cannot take, or takes and crashes on.
            (
                json!({"num_ctx": 1_u64 << 31}),
                "invalid option num_ctx: expected a non-negative integer (at most 2147483647)",
            ),
            (json!({"main_gpu": 1_u64 << 31}), "invalid option main_gpu: expected a non-negative integer (at most"),
            (
                json!({"num_thread": 100_000}),
                "invalid option num_thread: expected a non-negative integer (at most 512)",
            ),
            (json!({"main_gpu": [1]}), "invalid option main_gpu: expected a non-negative integer"),
            (json!({"num_gpu": "all"}), "invalid option num_gpu: expected an integer"),
            (json!({"use_mmap": 1}), "invalid option use_mmap: expected true or false"),
        ] {
            let err = LoadOverrides::parse(&map(&opts)).expect_err("bad").to_string();
            assert!(err.contains(message), "{opts}: {err}");
        }
        let (_dir, store) = store_with("FROM ./tiny.gguf\n");
        let missing =
            build(&store, &ModelName::parse("nope").expect("name"), &LoadOverrides::default(), None, false, DEFAULTS);
        assert_eq!(missing.expect_err("missing").to_string(), "model 'nope:latest' not found");
    }

    #[test]
    fn keep_alive_is_read_with_ollamas_forms() {
        let read = |v: Value| keep_alive(&map(&json!({ "keep_alive": v })), "keep_alive");
        assert_eq!(read(json!("10m")).expect("valid"), Some(KeepAlive::For(Duration::from_secs(600))));
        assert_eq!(read(json!(-1)).expect("valid"), Some(KeepAlive::Forever));
        assert_eq!(read(json!(1.5)).expect("valid"), Some(KeepAlive::For(Duration::from_millis(1500))));
        assert_eq!(read(Value::Null).expect("valid"), None);
        let err = read(json!("soon")).expect_err("bad").to_string();
        assert!(err.starts_with("invalid keep_alive \"soon\""), "{err}");
        let err = read(json!([1])).expect_err("bad").to_string();
        assert!(err.contains("expected a duration string"), "{err}");
    }
}
