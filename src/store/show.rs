//! What `/api/show` and `corralctl show` tell about a model: details from its config,
//! its text layers, a Modelfile that recreates it, and the GGUF metadata.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, PoisonError};
use std::time::SystemTime;

use serde_json::{Map, Value};

use super::digest::Digest;
use super::manifest::{self, Manifest, ModelConfig};
use super::modelfile::Message;
use super::name::ModelName;
use super::{Store, StoreError};
use crate::gguf::metadata::{self, ModelInfo};
use crate::gguf::reader::GgufFile;

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
    /// The GGUF metadata as JSON, as Ollama's `model_info`.
    pub model_info: Map<String, Value>,
}

/// A model's details as read from one version of its manifest file.
#[derive(Debug)]
pub(super) struct Cached {
    /// The manifest file's identity: inode, size and modification time.
    file: (u64, u64, SystemTime),
    details: Arc<ModelDetails>,
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
        let details = Arc::new(self.show(name, false)?);
        let entry = Cached { file, details: Arc::clone(&details) };
        self.details.lock().unwrap_or_else(PoisonError::into_inner).insert(name.clone(), entry);
        Ok(details)
    }

    /// [`Store::details`] when they are cached and current: one `stat`, cheap enough for
    /// an async task; `None` when they must be read (on the blocking pool).
    pub fn cached_details(&self, name: &ModelName) -> Result<Option<Arc<ModelDetails>>, StoreError> {
        self.lookup(name).map(|(_, cached)| cached)
    }

    /// The manifest file's identity, and the cached details if they came from it.
    #[allow(clippy::type_complexity)]
    fn lookup(&self, name: &ModelName) -> Result<((u64, u64, SystemTime), Option<Arc<ModelDetails>>), StoreError> {
        let file = self.manifest_identity(name)?;
        let cached = self
            .details
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .and_then(|c| (c.file == file).then(|| Arc::clone(&c.details)));
        Ok((file, cached))
    }

    /// Gathers what is known about a model. `verbose` includes large metadata arrays
    /// (tokenizer vocabularies) in `model_info`.
    pub fn show(&self, name: &ModelName, verbose: bool) -> Result<ModelDetails, StoreError> {
        let (manifest, digest, _) = self.manifest(name)?;
        let text = |media_type: &str| -> Result<Vec<String>, StoreError> {
            manifest
                .layers_of(media_type)
                .map(|l| self.read_blob(&l.digest).map(|b| String::from_utf8_lossy(&b).into_owned()))
                .collect()
        };
        let json = |media_type: &str| -> Result<Option<Value>, StoreError> {
            text(media_type)?
                .last()
                .map(|t| {
                    serde_json::from_str(t)
                        .map_err(|e| StoreError::Invalid(format!("{name}: bad {media_type} layer: {e}")))
                })
                .transpose()
        };
        let config_bytes = self.read_blob(&manifest.config.digest)?;
        let config: ModelConfig = serde_json::from_slice(&config_bytes).unwrap_or_default();
        let weights = manifest.model().expect("a parsed manifest has a model layer").digest;
        let file = std::io::BufReader::with_capacity(64 << 10, self.open_blob(&weights)?);
        let gguf = GgufFile::read_seekable(file)
            .map_err(|e| StoreError::Gguf { what: format!("{name} (blob {weights})"), message: e.to_string() })?;
        let info = ModelInfo::from_file(&gguf)
            .map_err(|e| StoreError::Gguf { what: format!("{name} (blob {weights})"), message: e.to_string() })?;
        let parameters = match json(manifest::PARAMS)? {
            Some(Value::Object(map)) => map.into_iter().collect(),
            _ => BTreeMap::new(),
        };
        let messages = json(manifest::MESSAGES)?.and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default();
        Ok(ModelDetails {
            name: name.clone(),
            digest,
            config,
            template: text(manifest::TEMPLATE)?.pop(),
            system: text(manifest::SYSTEM)?.pop(),
            licenses: text(manifest::LICENSE)?,
            parameters,
            messages,
            info,
            model_info: metadata::model_info(&gguf, verbose),
            manifest,
        })
    }
}

impl Store {
    /// A model's config blob (format, family, size, quantization); empty fields if it
    /// cannot be read, as Ollama lists a model whose config is damaged.
    #[must_use]
    pub fn model_config(&self, manifest: &Manifest) -> ModelConfig {
        let digest = manifest.config.digest;
        match self
            .read_blob(&digest)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<ModelConfig>(&b).map_err(|e| e.to_string()))
        {
            Ok(config) => config,
            Err(e) => {
                tracing::warn!(blob = %digest, error = %e, "cannot read a model's config blob");
                ModelConfig::default()
            }
        }
    }
}

impl ModelDetails {
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

    /// A Modelfile that recreates this model from its blobs.
    #[must_use]
    pub fn modelfile(&self, store: &Store) -> String {
        let mut out = format!(
            "# Modelfile generated by corral\n# To build a new Modelfile based on this one, replace FROM with:\n# FROM {}\n\n",
            self.name
        );
        if let Some(weights) = self.manifest.model() {
            let _ = writeln!(out, "FROM {}", store.blob_path(&weights.digest).display());
        }
        for adapter in self.manifest.layers_of(manifest::ADAPTER) {
            let _ = writeln!(out, "ADAPTER {}", store.blob_path(&adapter.digest).display());
        }
        if let Some(template) = &self.template {
            let _ = writeln!(out, "TEMPLATE \"\"\"{template}\"\"\"");
        }
        if let Some(system) = &self.system {
            let _ = writeln!(out, "SYSTEM \"\"\"{system}\"\"\"");
        }
        for line in self.parameters_text().lines() {
            let _ = writeln!(out, "PARAMETER {}", line.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        for license in &self.licenses {
            let _ = writeln!(out, "LICENSE \"\"\"{license}\"\"\"");
        }
        for message in &self.messages {
            let _ = writeln!(out, "MESSAGE {} \"\"\"{}\"\"\"", message.role, message.content);
        }
        out
    }
}
