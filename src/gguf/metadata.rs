//! The facts about a model that corral needs, drawn from a GGUF file's metadata: its
//! architecture and shape ([`ModelInfo`]), the memory its KV cache takes
//! ([`ModelInfo::kv_cache_bytes`]), and the `model_info` map of Ollama's `/api/show`
//! ([`model_info`]).
//!
//! Shape keys are named after the architecture (`llama.block_count`,
//! `bert.attention.head_count`, …), as llama.cpp's `LLM_KV_*` names are.

use serde_json::{Map, Number, Value};

use super::reader::GgufFile;
use super::{GgufArray, GgufValue};

/// The key naming the architecture, which prefixes the shape keys.
pub const KEY_ARCHITECTURE: &str = "general.architecture";

/// The most bytes of a string fact read into [`ModelInfo`] (an architecture, a name, a
/// type: a word or a title), which listings and the details cache keep per model.
pub const FACT_MAX: usize = 4096;

/// The most layers a per-layer list may give: eight times llama.cpp's `LLAMA_MAX_LAYERS`
/// (512, the size of its per-layer arrays), so a model it can load always reads.
pub const LAYERS_MAX: usize = 4096;

/// What a GGUF file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// A model `llama-server` loads with `--model`.
    Model,
    /// A multimodal projector (`--mmproj`): `general.type` `mmproj`, or architecture `clip`.
    Projector,
    /// An adapter applied to a model (`--lora`, `--control-vector`): `general.type`
    /// `adapter`, an `adapter.type` key, or architecture `controlvector`.
    Adapter,
}

/// How an embedding model pools token embeddings (`enum llama_pooling_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolingType {
    /// One embedding per token (0).
    None,
    /// The mean of the token embeddings (1).
    Mean,
    /// The first token's, `[CLS]` (2).
    Cls,
    /// The last token's (3).
    Last,
    /// A reranker's score (4).
    Rank,
    /// A value llama.cpp did not define when this was written.
    Other(u64),
}

impl PoolingType {
    /// The type of a `<arch>.pooling_type` value.
    #[must_use]
    pub const fn from_id(id: u64) -> Self {
        match id {
            0 => Self::None,
            1 => Self::Mean,
            2 => Self::Cls,
            3 => Self::Last,
            4 => Self::Rank,
            other => Self::Other(other),
        }
    }
}

/// A per-layer count such as the attention heads: one value for every layer, or one each
/// (llama.cpp accepts an array for `<arch>.attention.head_count` and `head_count_kv`;
/// hybrid models give 0 for layers without attention).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HeadCount {
    /// The same count in every layer.
    Uniform(u64),
    /// The count of each layer, first layer first.
    PerLayer(Vec<u64>),
}

impl HeadCount {
    /// The count in layer `layer` (from 0); `None` past the end of a per-layer list.
    #[must_use]
    pub fn layer(&self, layer: usize) -> Option<u64> {
        match self {
            Self::Uniform(n) => Some(*n),
            Self::PerLayer(v) => v.get(layer).copied(),
        }
    }

    /// The largest count of any layer (0 for an empty list).
    #[must_use]
    pub fn max(&self) -> u64 {
        match self {
            Self::Uniform(n) => *n,
            Self::PerLayer(v) => v.iter().copied().max().unwrap_or(0),
        }
    }

    /// The total over all layers: a uniform count times `layers`, or the sum of the
    /// per-layer list (which has one entry per layer, so `layers` is not needed).
    #[must_use]
    pub fn sum(&self, layers: u64) -> u64 {
        match self {
            Self::Uniform(n) => n.saturating_mul(layers),
            Self::PerLayer(v) => v.iter().fold(0u64, |a, &b| a.saturating_add(b)),
        }
    }
}

/// Why the metadata does not describe a model corral can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// No `general.architecture` string: llama.cpp loads no such file.
    #[error("the GGUF file has no {KEY_ARCHITECTURE} string, so llama.cpp cannot load it")]
    MissingArchitecture,
    /// A key holds a value of the wrong type.
    #[error("GGUF metadata key {key} holds {found}, where {expected} was expected")]
    WrongType {
        /// The key.
        key: String,
        /// What it should hold.
        expected: &'static str,
        /// What it holds.
        found: String,
    },
    /// A string fact longer than any model's (an architecture, a name, a type).
    #[error("GGUF metadata key {key} is {len} bytes long, more than the {max} corral reads")]
    TooLong {
        /// The key.
        key: String,
        /// Its length in bytes.
        len: usize,
        /// The most bytes read.
        max: usize,
    },
    /// A per-layer list longer than any model's.
    #[error("GGUF metadata key {key} lists {len} layers, more than the {max} corral reads")]
    TooManyLayers {
        /// The key.
        key: String,
        /// The list's length.
        len: usize,
        /// The most layers read.
        max: usize,
    },
    /// A per-layer list whose length is not the layer count.
    #[error("GGUF metadata key {key} lists {len} layers, but the model has {layers} ({block_count_key})")]
    LayerCount {
        /// The key.
        key: String,
        /// The list's length.
        len: usize,
        /// The layer count.
        layers: u64,
        /// The key giving the layer count.
        block_count_key: String,
    },
}

/// What corral needs to know about a model, from its GGUF metadata and tensor infos.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.architecture`: `llama`, `qwen2`, `bert`, `clip`, …
    pub architecture: String,
    /// `general.name`, if set.
    pub name: Option<String>,
    /// `general.type`: `model`, `mmproj`, `adapter`, …, if set.
    pub general_type: Option<String>,
    /// `adapter.type`: `lora`, …, if set.
    pub adapter_type: Option<String>,
    /// `<arch>.block_count`: the number of layers.
    pub block_count: Option<u64>,
    /// `<arch>.context_length`: the context the model was trained for.
    pub context_length: Option<u64>,
    /// `<arch>.embedding_length`.
    pub embedding_length: Option<u64>,
    /// `<arch>.attention.head_count`.
    pub head_count: Option<HeadCount>,
    /// `<arch>.attention.head_count_kv`, or the head count when absent (no grouping).
    pub head_count_kv: Option<HeadCount>,
    /// `<arch>.attention.key_length`, or the embedding length over the head count of
    /// layer 0 (as llama.cpp computes it; the largest head count if layer 0 has none).
    pub key_length: Option<u64>,
    /// `<arch>.attention.value_length`, defaulting like the key length.
    pub value_length: Option<u64>,
    /// `general.file_type` (`enum llama_ftype`); see [`ModelInfo::file_type_name`].
    pub file_type: Option<u32>,
    /// `tokenizer.ggml.model`: `llama` (sentencepiece), `gpt2` (BPE), `bert`, …
    pub tokenizer_model: Option<String>,
    /// `general.parameter_count`, or the elements of all tensors when absent.
    pub parameter_count: u64,
    /// `<arch>.pooling_type`, set for embedding models.
    pub pooling_type: Option<PoolingType>,
}

impl ModelInfo {
    /// Draws the facts from a file read by [`GgufFile`].  Only `general.architecture` is
    /// required; a key of the wrong type or a per-layer list of the wrong length is an error.
    pub fn from_file(file: &GgufFile) -> Result<Self, MetadataError> {
        let architecture = string(file, KEY_ARCHITECTURE)
            .map_err(|e| if let MetadataError::TooLong { .. } = e { e } else { MetadataError::MissingArchitecture })?
            .ok_or(MetadataError::MissingArchitecture)?;
        let arch = |suffix: &str| format!("{architecture}.{suffix}");
        let block_count = uint(file, &arch("block_count"))?;
        let embedding_length = uint(file, &arch("embedding_length"))?;
        let layered = |key: &str| -> Result<Option<HeadCount>, MetadataError> {
            let count = head_count(file, key)?;
            match (&count, block_count) {
                (Some(HeadCount::PerLayer(v)), Some(layers)) if v.len() as u64 != layers => {
                    Err(MetadataError::LayerCount {
                        key: key.to_owned(),
                        len: v.len(),
                        layers,
                        block_count_key: arch("block_count"),
                    })
                }
                _ => Ok(count),
            }
        };
        let head_count = layered(&arch("attention.head_count"))?;
        let head_count_kv = layered(&arch("attention.head_count_kv"))?.or_else(|| head_count.clone());
        let head_dim = match (embedding_length, &head_count) {
            (Some(embd), Some(heads)) => {
                let heads = heads.layer(0).filter(|&n| n > 0).unwrap_or_else(|| heads.max());
                embd.checked_div(heads)
            }
            _ => None,
        };
        let key_length = uint(file, &arch("attention.key_length"))?.or(head_dim);
        let value_length = uint(file, &arch("attention.value_length"))?.or(head_dim);
        let file_type = match uint(file, "general.file_type")? {
            None => None,
            Some(n) => Some(u32::try_from(n).map_err(|_| wrong_type("general.file_type", "a u32", file))?),
        };
        Ok(Self {
            name: string(file, "general.name")?,
            general_type: string(file, "general.type")?,
            adapter_type: string(file, "adapter.type")?,
            block_count,
            context_length: uint(file, &arch("context_length"))?,
            embedding_length,
            head_count,
            head_count_kv,
            key_length,
            value_length,
            file_type,
            tokenizer_model: string(file, "tokenizer.ggml.model")?,
            parameter_count: parameter_count(file),
            pooling_type: uint(file, &arch("pooling_type"))?.map(PoolingType::from_id),
            architecture,
        })
    }

    /// Whether this is a model, a projector or an adapter.
    #[must_use]
    pub fn kind(&self) -> ModelKind {
        let general_type = self.general_type.as_deref();
        if general_type == Some("mmproj") || self.architecture == "clip" {
            ModelKind::Projector
        } else if general_type == Some("adapter") || self.adapter_type.is_some() || self.architecture == "controlvector"
        {
            ModelKind::Adapter
        } else {
            ModelKind::Model
        }
    }

    /// The name of [`ModelInfo::file_type`], such as `F16` or `Q4_K_M`.
    #[must_use]
    pub fn file_type_name(&self) -> Option<&'static str> {
        self.file_type.and_then(file_type_name)
    }

    /// The most KV heads in any layer (0 when unknown).
    #[must_use]
    pub fn kv_head_count_max(&self) -> u64 {
        self.head_count_kv.as_ref().map_or(0, HeadCount::max)
    }

    /// The KV heads of all layers together (0 when unknown).
    #[must_use]
    pub fn kv_head_count_sum(&self) -> u64 {
        let layers = self.block_count.unwrap_or(0);
        self.head_count_kv.as_ref().map_or(0, |h| h.sum(layers))
    }

    /// The bytes of an f16 KV cache for `ctx` tokens in each of `parallel` sequences: for
    /// every layer, its KV heads × (key length + value length) × `ctx` × `parallel` × 2
    /// bytes, which is `2 × layers × kv_heads × head_dim × ctx × parallel × 2` when keys
    /// and values are `head_dim` long.  0 when the shape is unknown (projectors, adapters);
    /// saturates rather than overflows.
    #[must_use]
    pub fn kv_cache_bytes(&self, ctx: u64, parallel: u64) -> u64 {
        let (Some(key), Some(value)) = (self.key_length, self.value_length) else { return 0 };
        self.kv_head_count_sum()
            .saturating_mul(key.saturating_add(value))
            .saturating_mul(ctx)
            .saturating_mul(parallel)
            .saturating_mul(2)
    }
}

/// The name of a `general.file_type` value (`enum llama_ftype`), as llama.cpp writes it
/// without the `LLAMA_FTYPE_MOSTLY_` prefix; `None` for values it does not define.
#[must_use]
pub const fn file_type_name(file_type: u32) -> Option<&'static str> {
    Some(match file_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_1_F16",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        39 => "NVFP4",
        40 => "Q1_0",
        _ => return None,
    })
}

/// `general.parameter_count` when it is an unsigned integer, else the element count of
/// all tensors.
#[must_use]
pub fn parameter_count(file: &GgufFile) -> u64 {
    uint(file, "general.parameter_count")
        .ok()
        .flatten()
        .unwrap_or_else(|| file.tensors().iter().fold(0u64, |n, t| n.saturating_add(t.element_count())))
}

/// The `model_info` map of Ollama's `/api/show`: every metadata pair but `general.name`
/// and `tokenizer.chat_template` (shown elsewhere), with `general.parameter_count` set
/// (see [`parameter_count`]).  Unless `verbose`, arrays with elements (vocabularies,
/// merges, scores) are `null`, as Ollama shows them; empty ones stay `[]`. Verbose or not,
/// what is shown is bounded: an array longer than [`SHOWN_ARRAY_MAX`], or a value that
/// would take the whole past [`SHOWN_BUDGET`], is `null` too (a hostile file's
/// million-element arrays and 64 MiB strings would otherwise take gigabytes as JSON).
#[must_use]
pub fn model_info(file: &GgufFile, verbose: bool) -> Map<String, Value> {
    let mut budget = SHOWN_BUDGET;
    let mut map: Map<String, Value> = file
        .metadata()
        .iter()
        .filter(|(key, _)| key != "general.name" && key != "tokenizer.chat_template")
        .map(|(key, value)| {
            let json = match value {
                GgufValue::Array(a) if !verbose && !a.is_empty() => Value::Null,
                // Within the limits, or left out like the arrays of a brief show.
                other => match json_cost(other, budget) {
                    Some(cost) => {
                        budget -= cost;
                        to_json(other)
                    }
                    None => Value::Null,
                },
            };
            (key.clone(), json)
        })
        .collect();
    map.insert("general.parameter_count".into(), parameter_count(file).into());
    map
}

/// The most elements of one array (nested arrays count on their own) that `model_info`
/// shows; a longer array is shown as `null`. Real vocabularies have up to ~500 000.
pub const SHOWN_ARRAY_MAX: usize = 1 << 20;

/// What the values `model_info` shows may take together, in bytes: each value's JSON
/// text plus its size in memory (32 bytes a value, and a string's copy). A value that
/// would go past it is shown as `null`. A 256k-token vocabulary takes about 40 MiB.
pub const SHOWN_BUDGET: u64 = 128 << 20;

/// What `value` costs as JSON (see [`SHOWN_BUDGET`]), or `None` when it costs more than
/// `left` or holds an array longer than [`SHOWN_ARRAY_MAX`]. Stops counting as soon as
/// it knows.
fn json_cost(value: &GgufValue, left: u64) -> Option<u64> {
    const VALUE: u64 = 32;
    let cost = match value {
        GgufValue::String(s) => string_cost(s),
        GgufValue::Array(a) => return array_cost(a, left),
        // The longest number is 24 characters (`-1.7976931348623157e308`).
        _ => VALUE + 24,
    };
    (cost <= left).then_some(cost)
}

fn string_cost(s: &str) -> u64 {
    // The copy, the quotes, and each character as JSON writes it (`\u001f` for a control).
    let escaped: u64 = s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' => 2,
            0..0x20 => 6,
            _ => 1,
        })
        .sum();
    32 + s.len() as u64 + 2 + escaped
}

fn array_cost(array: &GgufArray, left: u64) -> Option<u64> {
    fn each<T>(v: &[T], left: u64, cost: impl Fn(&T) -> Option<u64>) -> Option<u64> {
        if v.len() > SHOWN_ARRAY_MAX {
            return None;
        }
        let mut total = 34u64;
        for x in v {
            // The element and its comma.
            total = total.checked_add(cost(x)? + 1)?;
            if total > left {
                return None;
            }
        }
        (total <= left).then_some(total)
    }
    #[allow(clippy::unnecessary_wraps, reason = "the shape `each` takes")]
    fn number<T>(_: &T) -> Option<u64> {
        Some(32 + 24)
    }
    match array {
        GgufArray::U8(v) => each(v, left, number),
        GgufArray::I8(v) => each(v, left, number),
        GgufArray::U16(v) => each(v, left, number),
        GgufArray::I16(v) => each(v, left, number),
        GgufArray::U32(v) => each(v, left, number),
        GgufArray::I32(v) => each(v, left, number),
        GgufArray::U64(v) => each(v, left, number),
        GgufArray::I64(v) => each(v, left, number),
        GgufArray::F32(v) => each(v, left, number),
        GgufArray::F64(v) => each(v, left, number),
        GgufArray::Bool(v) => each(v, left, number),
        GgufArray::String(v) => each(v, left, |s| Some(string_cost(s))),
        GgufArray::Array(v) => each(v, left, |a| array_cost(a, left)),
    }
}

/// A metadata value as JSON.  An `f32` becomes the shortest decimal that reads back as it
/// (`1e-5`, not `9.999999747378752e-6`); a non-finite float becomes `null`.
#[must_use]
pub fn to_json(value: &GgufValue) -> Value {
    match value {
        GgufValue::U8(v) => (*v).into(),
        GgufValue::I8(v) => (*v).into(),
        GgufValue::U16(v) => (*v).into(),
        GgufValue::I16(v) => (*v).into(),
        GgufValue::U32(v) => (*v).into(),
        GgufValue::I32(v) => (*v).into(),
        GgufValue::U64(v) => (*v).into(),
        GgufValue::I64(v) => (*v).into(),
        GgufValue::F32(v) => f32_json(*v),
        GgufValue::F64(v) => Number::from_f64(*v).map_or(Value::Null, Value::Number),
        GgufValue::Bool(v) => (*v).into(),
        GgufValue::String(v) => v.as_str().into(),
        GgufValue::Array(a) => array_json(a),
    }
}

fn f32_json(v: f32) -> Value {
    v.to_string().parse::<f64>().ok().and_then(Number::from_f64).map_or(Value::Null, Value::Number)
}

fn array_json(array: &GgufArray) -> Value {
    fn all<T: Copy>(v: &[T], f: impl Fn(T) -> Value) -> Value {
        Value::Array(v.iter().map(|&x| f(x)).collect())
    }
    match array {
        GgufArray::U8(v) => all(v, Value::from),
        GgufArray::I8(v) => all(v, Value::from),
        GgufArray::U16(v) => all(v, Value::from),
        GgufArray::I16(v) => all(v, Value::from),
        GgufArray::U32(v) => all(v, Value::from),
        GgufArray::I32(v) => all(v, Value::from),
        GgufArray::U64(v) => all(v, Value::from),
        GgufArray::I64(v) => all(v, Value::from),
        GgufArray::F32(v) => all(v, f32_json),
        GgufArray::F64(v) => all(v, |x| Number::from_f64(x).map_or(Value::Null, Value::Number)),
        GgufArray::Bool(v) => all(v, Value::from),
        GgufArray::String(v) => Value::Array(v.iter().map(|s| Value::from(s.as_str())).collect()),
        GgufArray::Array(v) => Value::Array(v.iter().map(array_json).collect()),
    }
}

/// A short description of a value, for errors: `a string ("abc")`, `an array of 3 u32`.
fn describe(value: &GgufValue) -> String {
    const TYPES: [&str; 13] =
        ["u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"];
    let name = |id: u32| TYPES.get(id as usize).copied().unwrap_or("?");
    match value {
        GgufValue::Array(a) => format!("an array of {} {}", a.len(), name(a.element_type_id())),
        GgufValue::String(s) if s.len() <= 40 => format!("a string ({s:?})"),
        GgufValue::String(_) => "a long string".to_owned(),
        other => {
            let name = name(other.type_id());
            let article = if name.starts_with(['i', 'u']) && name != "u8" { "an" } else { "a" };
            format!("{article} {name} ({})", to_json(other))
        }
    }
}

fn wrong_type(key: &str, expected: &'static str, file: &GgufFile) -> MetadataError {
    let found = file.get(key).map_or_else(|| "nothing".to_owned(), describe);
    MetadataError::WrongType { key: key.to_owned(), expected, found }
}

fn string(file: &GgufFile, key: &str) -> Result<Option<String>, MetadataError> {
    match file.get(key) {
        None => Ok(None),
        Some(GgufValue::String(s)) if s.len() > FACT_MAX => {
            Err(MetadataError::TooLong { key: key.to_owned(), len: s.len(), max: FACT_MAX })
        }
        Some(GgufValue::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(wrong_type(key, "a string", file)),
    }
}

/// A non-negative integer of any width.
fn as_uint(value: &GgufValue) -> Option<u64> {
    match *value {
        GgufValue::U8(v) => Some(v.into()),
        GgufValue::U16(v) => Some(v.into()),
        GgufValue::U32(v) => Some(v.into()),
        GgufValue::U64(v) => Some(v),
        GgufValue::I8(v) => u64::try_from(v).ok(),
        GgufValue::I16(v) => u64::try_from(v).ok(),
        GgufValue::I32(v) => u64::try_from(v).ok(),
        GgufValue::I64(v) => u64::try_from(v).ok(),
        _ => None,
    }
}

fn uint(file: &GgufFile, key: &str) -> Result<Option<u64>, MetadataError> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => as_uint(v).map(Some).ok_or_else(|| wrong_type(key, "a non-negative integer", file)),
    }
}

/// A count given once or per layer.
fn head_count(file: &GgufFile, key: &str) -> Result<Option<HeadCount>, MetadataError> {
    fn each<T: Copy>(v: &[T], f: impl Fn(T) -> Option<u64>) -> Option<Vec<u64>> {
        v.iter().map(|&x| f(x)).collect()
    }
    let list = match file.get(key) {
        None => return Ok(None),
        Some(GgufValue::Array(a)) if a.len() > LAYERS_MAX => {
            return Err(MetadataError::TooManyLayers { key: key.to_owned(), len: a.len(), max: LAYERS_MAX });
        }
        Some(GgufValue::Array(a)) => match a {
            GgufArray::U8(v) => each(v, |x| Some(x.into())),
            GgufArray::U16(v) => each(v, |x| Some(x.into())),
            GgufArray::U32(v) => each(v, |x| Some(x.into())),
            GgufArray::U64(v) => each(v, Some),
            GgufArray::I8(v) => each(v, |x| u64::try_from(x).ok()),
            GgufArray::I16(v) => each(v, |x| u64::try_from(x).ok()),
            GgufArray::I32(v) => each(v, |x| u64::try_from(x).ok()),
            GgufArray::I64(v) => each(v, |x| u64::try_from(x).ok()),
            _ => None,
        },
        Some(scalar) => return Ok(Some(HeadCount::Uniform(as_uint(scalar).ok_or_else(|| wrong(file, key))?))),
    };
    list.map(|v| Some(HeadCount::PerLayer(v))).ok_or_else(|| wrong(file, key))
}

fn wrong(file: &GgufFile, key: &str) -> MetadataError {
    wrong_type(key, "a non-negative integer or an array of them (one per layer)", file)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::super::reader::GgufFile;
    use super::super::{GgufArray, GgufValue, GgufWriter, TensorType};
    use super::{
        FACT_MAX, HeadCount, LAYERS_MAX, MetadataError, ModelInfo, ModelKind, PoolingType, SHOWN_ARRAY_MAX,
        file_type_name, model_info, to_json,
    };

    fn tiny(which: &str) -> GgufFile {
        let bytes = match which {
            "llama" => crate::demo_model::tiny_llama_bytes(),
            _ => crate::demo_model::tiny_bert_bytes(),
        }
        .expect("build the model");
        GgufFile::from_bytes(&bytes).expect("read the model")
    }

    /// A file with these metadata pairs and one 2×3 F16 tensor.
    fn file(pairs: &[(&str, GgufValue)]) -> GgufFile {
        let mut w = GgufWriter::new();
        for (key, value) in pairs {
            w.add_metadata(key, value.clone()).expect("kv");
        }
        w.add_tensor("t", &[2, 3], TensorType::F16, &[0.0; 6]).expect("tensor");
        GgufFile::from_bytes(&w.to_bytes()).expect("read")
    }

    fn info(pairs: &[(&str, GgufValue)]) -> Result<ModelInfo, MetadataError> {
        ModelInfo::from_file(&file(pairs))
    }

    #[test]
    fn the_tiny_llama() {
        let file = tiny("llama");
        let info = ModelInfo::from_file(&file).expect("info");
        assert_eq!(info.architecture, "llama");
        assert_eq!(info.name.as_deref(), Some("corral-tiny-llama"));
        assert_eq!(info.kind(), ModelKind::Model);
        assert_eq!(info.block_count, Some(4));
        assert_eq!(info.context_length, Some(2048));
        assert_eq!(info.embedding_length, Some(64));
        assert_eq!(info.head_count, Some(HeadCount::Uniform(4)));
        assert_eq!(info.head_count_kv, Some(HeadCount::Uniform(2)));
        assert_eq!((info.key_length, info.value_length), (Some(16), Some(16)));
        assert_eq!((info.kv_head_count_max(), info.kv_head_count_sum()), (2, 8));
        assert_eq!(info.file_type, Some(1));
        assert_eq!(info.file_type_name(), Some("F16"));
        assert_eq!(info.tokenizer_model.as_deref(), Some("llama"));
        assert_eq!(info.pooling_type, None);
        let elements: u64 = file.tensors().iter().map(|t| t.dims.iter().product::<u64>()).sum();
        assert!(info.parameter_count > 100_000);
        assert_eq!(info.parameter_count, elements);
        // 2 (K and V) × 4 layers × 2 KV heads × 16 × 2048 tokens × 2 bytes = 1 MiB.
        assert_eq!(info.kv_cache_bytes(2048, 1), 1 << 20);
        assert_eq!(info.kv_cache_bytes(1024, 4), 2 << 20);
        assert_eq!(info.kv_cache_bytes(u64::MAX, 2), u64::MAX, "saturates");
    }

    #[test]
    fn the_tiny_bert() {
        let info = ModelInfo::from_file(&tiny("bert")).expect("info");
        assert_eq!(info.architecture, "bert");
        assert_eq!(info.kind(), ModelKind::Model);
        assert_eq!((info.block_count, info.context_length, info.embedding_length), (Some(4), Some(512), Some(64)));
        assert_eq!(info.head_count, Some(HeadCount::Uniform(4)));
        assert_eq!(info.head_count_kv, Some(HeadCount::Uniform(4)), "defaults to the head count");
        assert_eq!(info.file_type_name(), Some("F16"));
        assert_eq!(info.tokenizer_model.as_deref(), Some("bert"));
        assert_eq!(info.pooling_type, Some(PoolingType::Mean));
        assert!(info.parameter_count > 0);
        assert_eq!(info.kv_cache_bytes(512, 1), 2 * 4 * 4 * 16 * 512 * 2);
    }

    #[test]
    fn projectors_and_adapters_are_told_apart() {
        let kind = |pairs: &[(&str, GgufValue)]| info(pairs).expect("info").kind();
        assert_eq!(kind(&[("general.architecture", "clip".into())]), ModelKind::Projector);
        let mmproj = [("general.architecture", "llava".into()), ("general.type", "mmproj".into())];
        assert_eq!(kind(&mmproj), ModelKind::Projector);
        let lora = [
            ("general.architecture", "llama".into()),
            ("general.type", "adapter".into()),
            ("adapter.type", "lora".into()),
            ("adapter.lora.alpha", 16f32.into()),
        ];
        assert_eq!(kind(&lora), ModelKind::Adapter);
        assert_eq!(info(&lora).expect("info").adapter_type.as_deref(), Some("lora"));
        assert_eq!(
            kind(&[("general.architecture", "qwen2".into()), ("adapter.type", "lora".into())]),
            ModelKind::Adapter
        );
        assert_eq!(kind(&[("general.architecture", "controlvector".into())]), ModelKind::Adapter);
        assert_eq!(
            kind(&[("general.architecture", "llama".into()), ("general.type", "model".into())]),
            ModelKind::Model
        );
        let adapter = info(&lora).expect("info");
        assert_eq!((adapter.block_count, adapter.kv_cache_bytes(4096, 1)), (None, 0));
        assert_eq!(adapter.parameter_count, 6, "the one 2×3 tensor");
    }

    #[test]
    fn per_layer_head_counts() {
        let pairs = |kv: GgufValue| {
            [
                ("general.architecture", "hybrid".into()),
                ("hybrid.block_count", 4u32.into()),
                ("hybrid.embedding_length", 256u64.into()),
                ("hybrid.attention.head_count", vec![8u32, 8, 4, 8].into()),
                ("hybrid.attention.head_count_kv", kv),
            ]
        };
        let i = info(&pairs(vec![2i32, 0, 1, 2].into())).expect("info");
        assert_eq!(i.head_count, Some(HeadCount::PerLayer(vec![8, 8, 4, 8])));
        assert_eq!(i.head_count_kv, Some(HeadCount::PerLayer(vec![2, 0, 1, 2])));
        assert_eq!((i.kv_head_count_max(), i.kv_head_count_sum()), (2, 5));
        assert_eq!(i.key_length, Some(32), "256 over layer 0's 8 heads");
        assert_eq!(i.kv_cache_bytes(100, 3), 5 * (32 + 32) * 100 * 3 * 2);
        let h = HeadCount::PerLayer(vec![2, 0, 1, 2]);
        assert_eq!((h.layer(1), h.layer(4), h.max(), h.sum(99)), (Some(0), None, 2, 5));
        let h = HeadCount::Uniform(3);
        assert_eq!((h.layer(1000), h.max(), h.sum(4)), (Some(3), 3, 12));
        assert_eq!(HeadCount::PerLayer(Vec::new()).max(), 0);

        let e = info(&pairs(vec![2u8, 2, 2].into())).expect_err("3 of 4 layers");
        assert_eq!(
            e,
            MetadataError::LayerCount {
                key: "hybrid.attention.head_count_kv".into(),
                len: 3,
                layers: 4,
                block_count_key: "hybrid.block_count".into(),
            }
        );
        assert!(e.to_string().contains("lists 3 layers, but the model has 4 (hybrid.block_count)"), "{e}");
        let e = info(&pairs(vec![2i32, -1, 2, 2].into())).expect_err("negative");
        assert!(matches!(e, MetadataError::WrongType { .. }), "{e}");
        let e = info(&pairs(vec![1.0f32; 4].into())).expect_err("floats");
        assert!(e.to_string().contains("holds an array of 4 f32"), "{e}");
        let e = info(&pairs("2".into())).expect_err("string");
        assert!(e.to_string().contains("holds a string (\"2\"), where a non-negative integer"), "{e}");
    }

    /// A hostile header's lists and strings are refused past what any model has, before
    /// they are copied into the facts every listing and the details cache keep.
    #[test]
    fn facts_past_any_models_are_refused() {
        let layers = u32::try_from(LAYERS_MAX + 1).expect("fits");
        let e = info(&[
            ("general.architecture", "llama".into()),
            ("llama.block_count", layers.into()),
            ("llama.attention.head_count", vec![1u8; LAYERS_MAX + 1].into()),
        ])
        .expect_err("too many layers");
        assert_eq!(
            e.to_string(),
            format!(
                "GGUF metadata key llama.attention.head_count lists {} layers, more than the 4096 corral reads",
                LAYERS_MAX + 1
            )
        );
        let at_most = info(&[
            ("general.architecture", "llama".into()),
            ("llama.block_count", 4096u32.into()),
            ("llama.attention.head_count", vec![1u8; LAYERS_MAX].into()),
        ]);
        assert_eq!(at_most.expect("at the limit").kv_head_count_sum(), 4096);
        for key in ["general.architecture", "general.name", "general.type", "tokenizer.ggml.model"] {
            let mut pairs = vec![("general.architecture", GgufValue::from("llama"))];
            pairs.retain(|(k, _)| *k != key);
            pairs.push((key, "x".repeat(FACT_MAX + 1).as_str().into()));
            let e = info(&pairs).expect_err(key);
            assert_eq!(
                e.to_string(),
                format!("GGUF metadata key {key} is 4097 bytes long, more than the 4096 corral reads")
            );
        }
    }

    #[test]
    fn explicit_lengths_and_counts_win() {
        let i = info(&[
            ("general.architecture", "deepseek2".into()),
            ("general.parameter_count", 671_000_000_000u64.into()),
            ("deepseek2.block_count", 61u32.into()),
            ("deepseek2.embedding_length", 7168u32.into()),
            ("deepseek2.attention.head_count", 128u32.into()),
            ("deepseek2.attention.key_length", 192u32.into()),
            ("deepseek2.attention.value_length", 128u32.into()),
            ("general.file_type", 15u32.into()),
        ])
        .expect("info");
        assert_eq!((i.key_length, i.value_length), (Some(192), Some(128)));
        assert_eq!(i.parameter_count, 671_000_000_000);
        assert_eq!(i.file_type_name(), Some("Q4_K_M"));
        assert_eq!(i.kv_cache_bytes(1, 1), 61 * 128 * (192 + 128) * 2);
        let no_heads = info(&[("general.architecture", "mamba".into()), ("mamba.embedding_length", 64u32.into())]);
        let no_heads = no_heads.expect("info");
        assert_eq!((no_heads.key_length, no_heads.kv_cache_bytes(100, 1)), (None, 0));
        let zero = info(&[
            ("general.architecture", "x".into()),
            ("x.embedding_length", 64u32.into()),
            ("x.attention.head_count", 0u32.into()),
        ]);
        assert_eq!(zero.expect("info").key_length, None, "no division by zero");
    }

    #[test]
    fn wrong_or_missing_keys_are_errors() {
        assert_eq!(info(&[]), Err(MetadataError::MissingArchitecture));
        assert_eq!(info(&[("general.architecture", 3u32.into())]), Err(MetadataError::MissingArchitecture));
        let e = info(&[("general.architecture", "llama".into()), ("llama.block_count", "four".into())]).expect_err("x");
        assert_eq!(
            e.to_string(),
            "GGUF metadata key llama.block_count holds a string (\"four\"), where a non-negative integer was expected"
        );
        let e = info(&[("general.architecture", "llama".into()), ("llama.context_length", (-1i32).into())]);
        assert!(e.expect_err("negative").to_string().contains("holds an i32 (-1)"));
        let e = info(&[("general.architecture", "llama".into()), ("general.file_type", u64::MAX.into())]);
        assert!(e.expect_err("too big").to_string().contains("where a u32 was expected"));
        let e = info(&[("general.architecture", "llama".into()), ("tokenizer.ggml.model", 1u8.into())]);
        assert!(e.expect_err("not a string").to_string().contains("holds a u8 (1), where a string"));
        let ok = info(&[("general.architecture", "llama".into()), ("llama.block_count", 4u8.into())]);
        assert_eq!(ok.expect("any integer width").block_count, Some(4));
    }

    #[test]
    fn file_type_names_follow_llama_cpp() {
        let names: Vec<_> = [0, 1, 2, 3, 7, 8, 9, 10, 15, 18, 30, 32, 36, 38].map(file_type_name).into();
        let want = ["F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q4_K_M", "Q6_K", "IQ4_XS", "BF16"];
        assert_eq!(names[..12], want.map(Some));
        assert_eq!(names[12..], [Some("TQ1_0"), Some("MXFP4_MOE")]);
        for unknown in [5, 6, 33, 34, 35, 41, 1024, u32::MAX] {
            assert_eq!(file_type_name(unknown), None, "{unknown}");
        }
        assert_eq!([0, 4, 7].map(PoolingType::from_id), [PoolingType::None, PoolingType::Rank, PoolingType::Other(7)]);
    }

    #[test]
    fn model_info_is_like_ollamas() {
        let file = tiny("llama");
        let map = model_info(&file, false);
        assert_eq!(map["general.architecture"], "llama");
        assert_eq!(map["llama.block_count"], 4);
        assert_eq!(map["llama.context_length"], 2048);
        assert_eq!(map["llama.attention.layer_norm_rms_epsilon"], json!(1e-5));
        assert_eq!(map["llama.rope.freq_base"], json!(10000.0));
        assert_eq!(map["tokenizer.ggml.add_bos_token"], true);
        assert_eq!(map["tokenizer.ggml.tokens"], Value::Null);
        assert_eq!(map["tokenizer.ggml.scores"], Value::Null);
        assert_eq!(map["general.parameter_count"], ModelInfo::from_file(&file).expect("info").parameter_count);
        assert!(!map.contains_key("general.name") && !map.contains_key("tokenizer.chat_template"));
        let keys: Vec<&String> = map.keys().collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "sorted");
        let verbose = model_info(&file, true);
        let tokens = verbose["tokenizer.ggml.tokens"].as_array().expect("tokens");
        assert_eq!(tokens[..2], [json!("<unk>"), json!("<s>")]);
        assert_eq!(verbose.len(), map.len());
        serde_json::to_string(&verbose).expect("serializes");

        let f = file_with_arrays();
        let map = model_info(&f, false);
        assert_eq!(map["empty"], json!([]));
        assert_eq!(map["general.parameter_count"], 6);
        assert_eq!(model_info(&f, true)["nested"], json!([[1, 2], ["a"], []]));
    }

    #[test]
    fn what_show_expands_is_bounded() {
        let big = "x".repeat(30 << 20);
        let f = file(&[
            ("long", GgufArray::U8(vec![7; SHOWN_ARRAY_MAX + 1]).into()),
            ("at_the_limit", GgufArray::I32(vec![1; SHOWN_ARRAY_MAX]).into()),
            ("nested", GgufArray::Array(vec![GgufArray::U8(vec![1; SHOWN_ARRAY_MAX + 1])]).into()),
            ("ok", GgufArray::U8(vec![7; 3]).into()),
            ("s1", GgufValue::String(big.clone())),
            ("s2", GgufValue::String(big)),
            ("small", GgufValue::String("after the budget ran out".into())),
        ]);
        let verbose = model_info(&f, true);
        assert_eq!(verbose["long"], Value::Null);
        assert_eq!(verbose["nested"], Value::Null);
        assert_eq!(verbose["at_the_limit"].as_array().map(Vec::len), Some(SHOWN_ARRAY_MAX));
        assert_eq!(verbose["ok"], json!([7, 7, 7]));
        assert_eq!(verbose["s1"].as_str().map(str::len), Some(30 << 20));
        // 30 MiB as JSON and in memory, twice over, after the arrays: the second is past the budget.
        assert!(verbose["s2"].is_null(), "past the budget");
        assert_eq!(verbose["small"], "after the budget ran out");
        // Without the arrays, both strings fit.
        let brief = model_info(&f, false);
        assert!(brief["long"].is_null() && brief["ok"].is_null());
        assert_eq!(brief["s2"].as_str().map(str::len), Some(30 << 20));
    }

    fn file_with_arrays() -> GgufFile {
        file(&[
            ("empty", GgufArray::U32(Vec::new()).into()),
            (
                "nested",
                GgufArray::Array(vec![
                    GgufArray::I16(vec![1, 2]),
                    GgufArray::String(vec!["a".into()]),
                    GgufArray::Array(Vec::new()),
                ])
                .into(),
            ),
        ])
    }

    #[test]
    fn values_become_json() {
        assert_eq!(to_json(&GgufValue::F32(0.1)), json!(0.1));
        assert_eq!(to_json(&GgufValue::F32(f32::NAN)), Value::Null);
        assert_eq!(to_json(&GgufValue::F64(f64::INFINITY)), Value::Null);
        assert_eq!(to_json(&GgufValue::I64(i64::MIN)), json!(i64::MIN));
        assert_eq!(to_json(&GgufValue::U64(u64::MAX)), json!(u64::MAX));
        assert_eq!(to_json(&GgufArray::F32(vec![1e-6, f32::INFINITY]).into()), json!([1e-6, null]));
        assert_eq!(to_json(&GgufArray::Bool(vec![true]).into()), json!([true]));
        assert_eq!(to_json(&GgufArray::F64(vec![0.5]).into()), json!([0.5]));
    }
}
