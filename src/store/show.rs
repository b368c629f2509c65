//! What `/api/show` and `corralctl show` tell about a model: details from its config,
//! its text layers, a Modelfile that recreates it, and the GGUF metadata.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::digest::Digest;
use super::limits::{self, ReadError, SmallBlob};
use super::manifest::{self, Layer, Manifest, ModelConfig, RootFs};
use super::manifests::FileId;
use super::modelfile::{Message, Modelfile, WriteError};
use super::name::ModelName;
use super::{Store, StoreError};
use crate::gguf::metadata::{self, ModelInfo};
use crate::gguf::reader::GgufFile;
use crate::sync::lock;

/// Everything shown about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDetails {
    /// The model's name.
    pub name: ModelName,
    /// Its manifest.
    pub manifest: Manifest,
    /// The digest of its manifest.
    pub digest: Digest,
    /// The config blob: format, family, parameter size, quantization.
    pub config: ModelConfig,
    /// The chat template layer (Go template text), if any.
    pub template: Option<String>,
    /// The system prompt, if any.
    pub system: Option<String>,
    /// License texts.
    pub licenses: Vec<String>,
    /// Default options.
    pub parameters: BTreeMap<String, Value>,
    /// Preset messages.
    pub messages: Vec<Message>,
    /// Facts from the weights' GGUF metadata.
    pub info: ModelInfo,
    /// The GGUF metadata as JSON, as Ollama's `model_info`; empty in [`Store::details`].
    pub model_info: Map<String, Value>,
}

/// A model's details as read from one version of its manifest file.
#[derive(Debug)]
struct Cached {
    /// The manifest file it was read from.
    file: FileId,
    details: Arc<ModelDetails>,
    /// About what it holds ([`held_bytes`]).
    bytes: usize,
    /// When it was put in, in insertions: the oldest goes first.
    added: u64,
}

/// The most bytes the details cache holds, by an estimate of its texts and layers: a
/// model's texts may be megabytes and copies of a model are cached apiece, so the number
/// of models alone does not bound it. Real models take a few kilobytes each.
pub const DETAILS_CACHE_MAX: usize = 64 << 20;

/// The details kept per model name ([`Store::details`]), within [`DETAILS_CACHE_MAX`].
#[derive(Debug, Default)]
pub(super) struct DetailsCache {
    entries: HashMap<ModelName, Cached>,
    /// The names by when they were put in, so the oldest is found without a scan.
    order: BTreeMap<u64, ModelName>,
    bytes: usize,
    added: u64,
}

impl DetailsCache {
    fn get(&self, name: &ModelName, file: FileId) -> Option<Arc<ModelDetails>> {
        self.entries.get(name).filter(|c| c.file == file).map(|c| Arc::clone(&c.details))
    }

    /// Keeps `details`, leaving out the entries put in longest ago while the cache would
    /// hold more than its bound (details larger than the bound alone are not kept).
    fn insert(&mut self, name: ModelName, file: FileId, details: Arc<ModelDetails>) {
        self.remove(&name);
        let bytes = held_bytes(&details);
        if bytes > DETAILS_CACHE_MAX {
            return;
        }
        while self.bytes + bytes > DETAILS_CACHE_MAX {
            let Some(oldest) = self.order.values().next().cloned() else { break };
            self.remove(&oldest);
        }
        self.added += 1;
        self.bytes += bytes;
        self.order.insert(self.added, name.clone());
        self.entries.insert(name, Cached { file, details, bytes, added: self.added });
    }

    /// How many models it holds, and its count of their bytes.
    #[cfg(test)]
    pub(super) fn held(&self) -> (usize, usize) {
        (self.entries.len(), self.bytes)
    }

    pub(super) fn remove(&mut self, name: &ModelName) {
        if let Some(gone) = self.entries.remove(name) {
            self.bytes -= gone.bytes;
            self.order.remove(&gone.added);
        }
    }
}

/// About the bytes a model's details hold: its texts, and a few hundred bytes for each
/// layer and everything else.
fn held_bytes(d: &ModelDetails) -> usize {
    let texts = d.template.iter().chain(&d.system).chain(&d.licenses).map(String::len).sum::<usize>();
    let messages = d.messages.iter().map(|m| m.role.len() + m.content.len() + 64).sum::<usize>();
    let parameters = d.parameters.iter().map(|(k, v)| k.len() + 64 + v.to_string().len()).sum::<usize>();
    let facts = [&d.info.name, &d.info.general_type, &d.info.adapter_type, &d.info.tokenizer_model];
    let info = d.info.architecture.len() + facts.into_iter().flatten().map(String::len).sum::<usize>();
    1024 + 256 * d.manifest.layers().len() + texts + messages + parameters + info
}

impl Store {
    /// [`Store::show`] without the large metadata arrays, kept per model until its
    /// manifest file changes: every request needs it, and reading a large model's GGUF
    /// header each time would cost milliseconds. Blobs never change under a digest, so
    /// the manifest file (inode, size, modification time) is all there is to check.
    pub fn details(&self, name: &ModelName) -> Result<Arc<ModelDetails>, StoreError> {
        let (file, cached) = self.lookup(name)?;
        if let Some(hit) = cached {
            return Ok(hit);
        }
        let details = Arc::new(self.read_details(name, None)?);
        lock(&self.details).insert(name.clone(), file, Arc::clone(&details));
        Ok(details)
    }

    /// [`Store::details`] when they are cached and current: one `stat`, cheap enough for
    /// an async task; `None` when they must be read (on the blocking pool).
    pub fn cached_details(&self, name: &ModelName) -> Result<Option<Arc<ModelDetails>>, StoreError> {
        self.lookup(name).map(|(_, cached)| cached)
    }

    /// [`Store::details`] for an async task: from the cache on the task (one `stat`), else
    /// read on the blocking pool (a first read parses the GGUF header).
    ///
    /// # Errors
    /// As [`Store::details`]; a reading task that panicked is an `Io` error.
    pub async fn details_async(&self, name: &ModelName) -> Result<Arc<ModelDetails>, StoreError> {
        if let Some(hit) = self.cached_details(name)? {
            return Ok(hit);
        }
        let (store, name) = (self.clone(), name.clone());
        tokio::task::spawn_blocking(move || store.details(&name)).await.map_err(|e| StoreError::Io {
            context: "the task reading a model's details failed".to_owned(),
            source: std::io::Error::other(e),
        })?
    }

    /// The manifest file's identity, and the cached details if they came from it.
    fn lookup(&self, name: &ModelName) -> Result<(FileId, Option<Arc<ModelDetails>>), StoreError> {
        let file = self.manifest_identity(name)?;
        let cached = lock(&self.details).get(name, file);
        Ok((file, cached))
    }

    /// Gathers what is known about a model. `verbose` includes large metadata arrays
    /// (tokenizer vocabularies) in `model_info`, within the limits of
    /// [`metadata::model_info`].
    pub fn show(&self, name: &ModelName, verbose: bool) -> Result<ModelDetails, StoreError> {
        self.read_details(name, Some(verbose))
    }

    /// What [`Store::show`] reads; without `model_info` when `info` is `None` (what the
    /// cache of [`Store::details`] holds: requests need the rest, and a model's metadata
    /// strings can be tens of megabytes).
    fn read_details(&self, name: &ModelName, info: Option<bool>) -> Result<ModelDetails, StoreError> {
        let (manifest, digest, _) = self.manifest(name)?;
        // The sizes the manifest declares first, then each read stops at its cap anyway.
        limits::check_manifest(&manifest)?;
        let mut budget = limits::MODEL_SMALL_BLOBS_MAX;
        let mut read = |kind: SmallBlob, layer: &Layer| -> Result<Vec<u8>, StoreError> {
            limits::read_small_blob(self.open_blob(&layer.digest)?, kind, &layer.digest, &mut budget).map_err(|e| {
                match e {
                    ReadError::Read(source) => {
                        StoreError::Io { context: format!("cannot read blob {}", layer.digest), source }
                    }
                    ReadError::TooLarge(e) => StoreError::TooLarge(e),
                }
            })
        };
        let config: ModelConfig =
            serde_json::from_slice(&read(SmallBlob::Config, manifest.config())?).unwrap_or_default();
        let (mut template, mut system, mut licenses, mut params, mut messages) = (None, None, Vec::new(), None, None);
        for (kind, layer) in limits::small_blobs(&manifest).skip(1) {
            let bytes = read(kind, layer)?;
            let text = || String::from_utf8_lossy(&bytes).into_owned();
            match kind {
                SmallBlob::Template => template = Some(text()),
                SmallBlob::System => system = Some(text()),
                SmallBlob::License => licenses.push(text()),
                SmallBlob::Params => params = Some((layer.media_type.clone(), bytes)),
                SmallBlob::Messages => messages = Some((layer.media_type.clone(), bytes)),
                SmallBlob::Config => {}
            }
        }
        let json = |layer: Option<(String, Vec<u8>)>| -> Result<Option<Value>, StoreError> {
            layer
                .map(|(media_type, bytes)| {
                    serde_json::from_slice(&bytes)
                        .map_err(|e| StoreError::Invalid(format!("{name}: bad {media_type} layer: {e}")))
                })
                .transpose()
        };
        let weights = manifest.model().digest;
        let file = std::io::BufReader::with_capacity(64 << 10, self.open_blob(&weights)?);
        let gguf = GgufFile::read_seekable(file)
            .map_err(|e| StoreError::Gguf { what: format!("{name} (blob {weights})"), message: e.to_string() })?;
        let model_info = info.map(|verbose| metadata::model_info(&gguf, verbose)).unwrap_or_default();
        let info = ModelInfo::from_file(&gguf)
            .map_err(|e| StoreError::Gguf { what: format!("{name} (blob {weights})"), message: e.to_string() })?;
        let parameters = match json(params)? {
            Some(Value::Object(map)) => map.into_iter().collect(),
            _ => BTreeMap::new(),
        };
        let messages = json(messages)?.and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default();
        Ok(ModelDetails {
            name: name.clone(),
            digest,
            config,
            template,
            system,
            licenses,
            parameters,
            messages,
            info,
            model_info,
            manifest,
        })
    }
}

impl Store {
    /// A model's config blob (format, family, size, quantization); empty fields if it
    /// cannot be read, is larger than [`limits::CONFIG_MAX`] or gives a fact longer than
    /// [`limits::CONFIG_FACT_MAX`], as Ollama lists a model whose config is damaged.
    #[must_use]
    pub fn model_config(&self, manifest: &Manifest) -> ModelConfig {
        let digest = manifest.config().digest;
        match self
            .read_blob(&digest, SmallBlob::Config)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<ModelConfig>(&b).map_err(|e| e.to_string()))
            .and_then(listed_facts)
        {
            Ok(config) => config,
            Err(e) => {
                tracing::warn!(blob = %digest, error = %e, "cannot read a model's config blob");
                ModelConfig::default()
            }
        }
    }
}

/// The facts of `config` that listings show, if each is within its bound; its layer list
/// (which only pushing reads, from the blob itself) left out.
pub(super) fn listed_facts(config: ModelConfig) -> Result<ModelConfig, String> {
    let families = config.model_families.as_deref().unwrap_or_default();
    let facts = [&config.model_format, &config.model_family, &config.model_type, &config.file_type]
        .into_iter()
        .chain([&config.os, &config.architecture])
        .chain(families);
    if let Some(long) = facts.into_iter().find(|fact| fact.len() > limits::CONFIG_FACT_MAX) {
        return Err(format!("a fact of {} bytes, over {}", long.len(), limits::CONFIG_FACT_MAX));
    }
    if families.len() > limits::CONFIG_FAMILIES_MAX {
        return Err(format!("{} model families, over {}", families.len(), limits::CONFIG_FAMILIES_MAX));
    }
    Ok(ModelConfig { rootfs: RootFs::default(), ..config })
}

/// Every capability [`ModelDetails::capabilities`] names.
pub const CAPABILITIES: [&str; 5] = ["completion", "embedding", "tools", "insert", "vision"];

/// What a model's blobs say that the views show of every model beside its config's
/// facts: the context length (from the GGUF header) and the capabilities (the header and
/// the template). The same for every model with the same manifest, which names every
/// blob: the store keeps them by the manifest's digest, in the saved listing too
/// ([`Store::blob_facts`]), so that neither a restart nor a second name reads a header
/// again (a large vocabulary makes a header several megabytes of strings).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlobFacts {
    /// The context the weights were trained for; 0 when they do not say.
    pub context_length: u64,
    /// As [`ModelDetails::capabilities`]: some of [`CAPABILITIES`].
    pub capabilities: Vec<&'static str>,
}

impl ModelDetails {
    /// Its [`BlobFacts`].
    #[must_use]
    pub fn blob_facts(&self) -> BlobFacts {
        BlobFacts { context_length: self.info.context_length.unwrap_or(0), capabilities: self.capabilities() }
    }

    /// What the model can do, as Ollama names it: "completion" or "embedding", then
    /// "tools" and "insert" (its template takes tools or a suffix) and "vision" (it has
    /// a projector).
    #[must_use]
    pub fn capabilities(&self) -> Vec<&'static str> {
        let template = self.template.as_deref().unwrap_or_default();
        let mut capabilities = vec![if self.info.pooling_type.is_some() { "embedding" } else { "completion" }];
        if template.contains(".Tools") {
            capabilities.push("tools");
        }
        if template.contains(".Suffix") {
            capabilities.push("insert");
        }
        if self.manifest.layers_of(manifest::PROJECTOR).next().is_some() {
            capabilities.push("vision");
        }
        capabilities
    }

    /// The parameters as Ollama's `/api/show` prints them: `name value` lines, aligned.
    #[must_use]
    pub fn parameters_text(&self) -> String {
        let mut out = String::new();
        for (key, value) in &self.parameters {
            let values = match value {
                Value::Array(items) => items.clone(),
                other => vec![other.clone()],
            };
            for v in values {
                let shown = match v {
                    Value::String(s) => format!("\"{s}\""),
                    other => other.to_string(),
                };
                let _ = writeln!(out, "{key:<30} {shown}");
            }
        }
        out
    }

    /// A Modelfile that recreates this model from its blobs: it reads back as the same
    /// weights, adapters, template, system prompt, parameters, licenses and messages,
    /// whatever their text (see [`Modelfile::write`]), or this is an error saying why not.
    pub fn modelfile(&self, store: &Store) -> Result<String, WriteError> {
        let path = |layer: &Layer| store.blob_path(&layer.digest).to_string_lossy().into_owned();
        let modelfile = Modelfile {
            from: path(self.manifest.model()),
            parameters: self.parameters.clone(),
            template: self.template.clone(),
            system: self.system.clone(),
            adapters: self.manifest.layers_of(manifest::ADAPTER).map(path).collect(),
            licenses: self.licenses.clone(),
            messages: self.messages.clone(),
        };
        let header = format!(
            "Modelfile generated by corral\nTo build a new Modelfile based on this one, replace FROM with:\nFROM {}",
            self.name
        );
        modelfile.write(&header)
    }
}
