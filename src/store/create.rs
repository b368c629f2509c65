//! Creating a model: weights from a GGUF on disk, a blob, or an existing model, plus
//! the layers a Modelfile adds (adapters, template, system prompt, parameters, licenses,
//! messages). Blobs are pinned from the first write until the manifest is written, and
//! the manifest is written last, so a failure at any step leaves no model behind.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::digest::Digest;
use super::limits::{self, SmallBlob};
use super::manifest::{self, Layer, Manifest, ModelConfig, RootFs};
use super::modelfile::{Message, Modelfile};
use super::name::ModelName;
use super::passed::PassedFile;
use super::progress::{Progress, Throttle};
use super::{Store, StoreError};
use crate::gguf::metadata::{ModelInfo, ModelKind};
use crate::gguf::reader::GgufFile;

/// Where weights (or an adapter) come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A GGUF file on disk.
    File(PathBuf),
    /// A file the caller passed open (D-Bus `CreateWithFiles`), checked.
    Passed(PassedFile),
    /// A blob already in the store (uploaded with `POST /api/blobs/<digest>`).
    Blob(Digest),
    /// An existing model, whose layers are inherited.
    Model(ModelName),
}

impl Source {
    /// Reads a Modelfile's `FROM`/`ADAPTER` value: a digest, a path (relative to
    /// `base_dir`), or a model name.
    pub fn parse(value: &str, base_dir: &Path) -> Result<Self, StoreError> {
        let value = value.trim();
        if value.starts_with("sha256:") || value.starts_with("sha256-") {
            return Digest::parse(value).map(Self::Blob).map_err(|e| StoreError::Invalid(e.to_string()));
        }
        let path = base_dir.join(value);
        let gguf_suffix = Path::new(value).extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let looks_like_path = value.starts_with(['.', '/', '~']) || gguf_suffix || path.exists();
        if looks_like_path {
            return Ok(Self::File(path));
        }
        ModelName::parse(value).map(Self::Model).map_err(|e| StoreError::Invalid(e.to_string()))
    }
}

/// What to create.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateSpec {
    /// The weights.
    pub from: Source,
    /// LoRA adapters (files or blobs).
    pub adapters: Vec<Source>,
    /// A chat template, replacing an inherited one.
    pub template: Option<String>,
    /// A system prompt, replacing an inherited one.
    pub system: Option<String>,
    /// License texts, replacing inherited ones when given.
    pub licenses: Vec<String>,
    /// Default options, merged over inherited ones.
    pub parameters: BTreeMap<String, Value>,
    /// Preset messages, replacing inherited ones when given.
    pub messages: Vec<Message>,
}

impl CreateSpec {
    /// The spec a Modelfile describes; paths in it are relative to `base_dir`.
    pub fn from_modelfile(modelfile: &Modelfile, base_dir: &Path) -> Result<Self, StoreError> {
        Self::from_modelfile_passing(modelfile, base_dir, &HashMap::new())
    }

    /// [`CreateSpec::from_modelfile`] where each `FROM` or `ADAPTER` value that is a key of
    /// `passed` is read from that file. A key no such line names is refused (a caller's
    /// mistake, which would otherwise read a path instead).
    pub fn from_modelfile_passing(
        modelfile: &Modelfile,
        base_dir: &Path,
        passed: &HashMap<String, PassedFile>,
    ) -> Result<Self, StoreError> {
        let values: HashSet<&str> =
            std::iter::once(&modelfile.from).chain(&modelfile.adapters).map(|v| v.trim()).collect();
        if let Some(unused) = passed.keys().find(|key| !values.contains(key.as_str())) {
            return Err(StoreError::Invalid(format!("{unused}: passed for no FROM or ADAPTER line")));
        }
        let source = |value: &str| match passed.get(value.trim()) {
            Some(file) => Ok(Source::Passed(file.clone())),
            None => Source::parse(value, base_dir),
        };
        Ok(Self {
            from: source(&modelfile.from)?,
            adapters: modelfile.adapters.iter().map(|a| source(a)).collect::<Result<_, _>>()?,
            template: modelfile.template.clone(),
            system: modelfile.system.clone(),
            licenses: modelfile.licenses.clone(),
            parameters: modelfile.parameters.clone(),
            messages: modelfile.messages.clone(),
        })
    }

    /// Checks the text and JSON this spec adds against the caps the store reads them with.
    /// Also their number, and their bytes together, so that a request of a million
    /// licenses is refused before the first is written.
    fn check_sizes(&self) -> Result<(), StoreError> {
        for (count, kind) in [(self.adapters.len(), "adapters"), (self.licenses.len(), "licenses")] {
            if count > limits::LAYERS_OF_A_KIND_MAX {
                return Err(StoreError::Invalid(format!(
                    "{count} {kind}; a model takes at most {}",
                    limits::LAYERS_OF_A_KIND_MAX
                )));
            }
        }
        // The texts as they are, the JSON layers as they will be written.
        let json = |kind: SmallBlob, bytes: Vec<u8>| (kind, Cow::Owned(bytes));
        let texts =
            (self.template.iter().map(|t| (SmallBlob::Template, Cow::Borrowed(t.as_bytes()))))
                .chain(self.system.iter().map(|t| (SmallBlob::System, Cow::Borrowed(t.as_bytes()))))
                .chain(self.licenses.iter().map(|t| (SmallBlob::License, Cow::Borrowed(t.as_bytes()))))
                .chain((!self.parameters.is_empty()).then(|| {
                    json(SmallBlob::Params, serde_json::to_vec(&self.parameters).expect("a JSON map serializes"))
                }))
                .chain((!self.messages.is_empty()).then(|| {
                    json(SmallBlob::Messages, serde_json::to_vec(&self.messages).expect("messages serialize"))
                }));
        let mut total = 0u64;
        for (kind, bytes) in texts {
            limits::check_data(kind, &bytes)?;
            total = total.saturating_add(bytes.len() as u64);
        }
        if total > limits::MODEL_SMALL_BLOBS_MAX {
            return Err(limits::TooLarge::total(total).into());
        }
        Ok(())
    }
}

impl Store {
    /// Creates (or replaces) model `name`. `progress` receives Ollama's status lines.
    /// Returns the new manifest's digest.
    pub fn create(
        &self,
        name: &ModelName,
        spec: &CreateSpec,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Digest, StoreError> {
        // Blobs named as inputs are pinned first: a garbage collection never takes one away
        // between the checks and the manifest.
        let blob_inputs = std::iter::once(&spec.from).chain(&spec.adapters).filter_map(|s| match s {
            Source::Blob(digest) => Some(*digest),
            _ => None,
        });
        let _inputs = self.pin(blob_inputs);
        // Every input is checked before anything is written: a bad file or reference changes nothing.
        spec.check_sizes()?;
        // The blobs' headers, read once (a blob never changes under its digest).
        let mut headers = HashMap::new();
        if let Source::Model(base) = &spec.from {
            self.manifest(base)?;
        } else {
            self.check_gguf(&spec.from, ModelKind::Model, &mut headers)?;
        }
        for adapter in &spec.adapters {
            self.check_gguf(adapter, ModelKind::Adapter, &mut headers)?;
        }
        let mut added = Vec::new();
        let result = self.write_model(name, spec, &headers, progress, &mut added);
        if result.is_err() {
            // A failure while writing (a full disk) takes back the blobs this create added.
            self.remove_unreferenced(added.into_iter().collect());
        }
        result
    }

    fn check_gguf(
        &self,
        source: &Source,
        expected: ModelKind,
        headers: &mut HashMap<Digest, ModelInfo>,
    ) -> Result<(), StoreError> {
        let (path, what) = match source {
            Source::File(path) => (path.clone(), path.display().to_string()),
            Source::Passed(passed) => {
                return check_kind(&model_info(passed.reader(), passed.name())?, expected, passed.name());
            }
            Source::Blob(digest) => {
                let what = digest.to_string();
                if !headers.contains_key(digest) {
                    headers.insert(*digest, self.inspect_blob(digest, &what)?);
                }
                return check_kind(&headers[digest], expected, &what);
            }
            Source::Model(name) => {
                return Err(StoreError::Invalid(format!(
                    "{name} is a model name; an adapter must be a GGUF file or a blob digest"
                )));
            }
        };
        check_kind(&self.inspect(&path, &what)?, expected, &what)
    }

    fn write_model(
        &self,
        name: &ModelName,
        spec: &CreateSpec,
        headers: &HashMap<Digest, ModelInfo>,
        progress: &mut dyn FnMut(Progress),
        added: &mut Vec<Digest>,
    ) -> Result<Digest, StoreError> {
        let mut pins = Vec::new();
        let mut layers: Vec<Layer> = Vec::new();

        let info = match &spec.from {
            Source::Model(base) => {
                let (base_manifest, _, _) = self.manifest(base)?;
                pins.push(self.pin(base_manifest.blobs().map(|l| l.digest)));
                layers.extend_from_slice(base_manifest.layers());
                let model = base_manifest.model();
                progress(Progress::step(&format!("using existing layer {}", model.digest)));
                self.inspect_blob(&model.digest, &format!("{base}"))?
            }
            source => {
                progress(Progress::step("parsing GGUF"));
                let (layer, info) =
                    self.gguf_layer(source, (ModelKind::Model, manifest::MODEL), headers, &mut pins, added, progress)?;
                layers.push(layer);
                info
            }
        };
        for adapter in &spec.adapters {
            let (layer, _) =
                self.gguf_layer(adapter, (ModelKind::Adapter, manifest::ADAPTER), headers, &mut pins, added, progress)?;
            layers.push(layer);
        }

        let mut text = TextLayers { store: self, layers: &mut layers, pins: &mut pins, added, progress };
        if let Some(template) = &spec.template {
            text.add(manifest::TEMPLATE, template.as_bytes(), true)?;
        }
        if let Some(system) = &spec.system {
            text.add(manifest::SYSTEM, system.as_bytes(), true)?;
        }
        if !spec.licenses.is_empty() {
            text.layers.retain(|l| l.media_type != manifest::LICENSE);
            for license in &spec.licenses {
                text.add(manifest::LICENSE, license.as_bytes(), false)?;
            }
        }
        if !spec.parameters.is_empty() {
            let mut merged = match text.layers.iter().find(|l| l.media_type == manifest::PARAMS) {
                Some(old) => self.read_json_blob::<BTreeMap<String, Value>>(&old.digest)?,
                None => BTreeMap::new(),
            };
            merged.extend(spec.parameters.clone());
            text.add(manifest::PARAMS, &serde_json::to_vec(&merged).expect("a JSON map serializes"), true)?;
        }
        if !spec.messages.is_empty() {
            text.add(manifest::MESSAGES, &serde_json::to_vec(&spec.messages).expect("messages serialize"), true)?;
        }

        let config = ModelConfig {
            model_format: "gguf".to_owned(),
            model_family: info.architecture.clone(),
            model_families: Some(vec![info.architecture.clone()]),
            model_type: human_count(info.parameter_count),
            file_type: info.file_type_name().unwrap_or("unknown").to_owned(),
            os: "linux".to_owned(),
            architecture: go_arch().to_owned(),
            rootfs: RootFs { kind: "layers".to_owned(), diff_ids: layers.iter().map(|l| l.digest).collect() },
        };
        let config_bytes = serde_json::to_vec(&config).expect("the config serializes");
        if !self.has_blob(&Digest::of(&config_bytes)) {
            added.push(Digest::of(&config_bytes));
        }
        let (config_digest, config_size, pin) = self.write_blob_pinned(&config_bytes[..], None)?;
        pins.push(pin);
        let manifest = Manifest::new(
            Layer {
                media_type: manifest::CONFIG_MEDIA_TYPE.to_owned(),
                digest: config_digest,
                size: config_size,
                from: None,
            },
            layers,
        )
        .map_err(|source| StoreError::Manifest { name: name.to_string(), source })?;
        // Inherited and new layers together within the caps (what the store will read back).
        limits::check_manifest(&manifest)?;
        progress(Progress::step("writing manifest"));
        let old = self.manifest(name).ok();
        let digest = self.write_manifest(name, &manifest)?;
        // Layers the replaced manifest had and the new one does not may now be unused.
        if let Some((old, _, _)) = old {
            let kept: HashSet<Digest> = manifest.blobs().map(|l| l.digest).collect();
            let candidates = old.blobs().map(|l| l.digest).filter(|d| !kept.contains(d)).collect();
            self.remove_unreferenced(candidates);
        }
        drop(pins);
        progress(Progress::step("success"));
        Ok(digest)
    }

    /// Adds a (checked) GGUF as a layer: imports a file, or takes a blob. A file is checked
    /// again once in the store: it may have changed since its first check.
    fn gguf_layer(
        &self,
        source: &Source,
        kind: (ModelKind, &str),
        headers: &HashMap<Digest, ModelInfo>,
        pins: &mut Vec<super::Pin>,
        added: &mut Vec<Digest>,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(Layer, ModelInfo), StoreError> {
        let (expected, media_type) = kind;
        let (digest, size, from, read) = match source {
            Source::File(path) => {
                let from = file_name(path);
                let label = path.display().to_string();
                let imported =
                    self.import_file_tracked(path, None, &mut reading(from.as_deref().unwrap_or(&label), progress))?;
                let (digest, size, info) = self.imported(imported, &label, expected, pins, added, progress)?;
                (digest, size, from, Some(info))
            }
            Source::Passed(passed) => {
                let from = file_name(Path::new(passed.name()));
                let imported =
                    self.import_passed(passed, &mut reading(from.as_deref().unwrap_or(passed.name()), progress))?;
                let (digest, size, info) = self.imported(imported, passed.name(), expected, pins, added, progress)?;
                (digest, size, from, Some(info))
            }
            Source::Blob(digest) => {
                pins.push(self.pin([*digest]));
                let size = self.blob_size(digest)?;
                progress(Progress::step(&format!("using existing layer {digest}")));
                (*digest, size, None, None)
            }
            Source::Model(name) => return Err(StoreError::Invalid(format!("{name} is not a GGUF file or blob"))),
        };
        let info = match (read, headers.get(&digest)) {
            (Some(info), _) => info,
            (None, Some(info)) => info.clone(),
            (None, None) => self.inspect_blob(&digest, &digest.to_string())?,
        };
        Ok((Layer { media_type: media_type.to_owned(), digest, size, from }, info))
    }

    /// Keeps a file just imported (pinned, and noted when new), once its copy in the store
    /// is checked to be a GGUF of the `expected` kind (the file may have changed since its
    /// first check); what that copy's header says.
    fn imported(
        &self,
        (digest, size, new, pin): (Digest, u64, bool, super::Pin),
        what: &str,
        expected: ModelKind,
        pins: &mut Vec<super::Pin>,
        added: &mut Vec<Digest>,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(Digest, u64, ModelInfo), StoreError> {
        pins.push(pin);
        if new {
            added.push(digest);
        }
        let info = self.inspect_blob(&digest, what)?;
        check_kind(&info, expected, what)?;
        let verb = if new { "creating new" } else { "using existing" };
        progress(Progress::step(&format!("{verb} layer {digest}")));
        Ok((digest, size, info))
    }

    /// Reads a GGUF file's metadata; `what` names it in errors. Anything but a regular
    /// file is refused before a byte is read (a FIFO would hang the open, a device never end).
    pub fn inspect(&self, path: &Path, what: &str) -> Result<ModelInfo, StoreError> {
        let (file, _) = super::passed::open_regular(path, what)?;
        model_info(file, what)
    }

    /// Reads a blob's GGUF metadata, opened through the store (a link is refused).
    pub fn inspect_blob(&self, digest: &Digest, what: &str) -> Result<ModelInfo, StoreError> {
        model_info(self.open_blob(digest)?, what)
    }

    fn read_json_blob<T: serde::de::DeserializeOwned>(&self, digest: &Digest) -> Result<T, StoreError> {
        let bytes = self.read_blob(digest, SmallBlob::Params)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| StoreError::Invalid(format!("blob {digest} is not the expected JSON: {e}")))
    }
}

/// Adds small text or JSON layers to a manifest under construction.
struct TextLayers<'a> {
    store: &'a Store,
    layers: &'a mut Vec<Layer>,
    pins: &'a mut Vec<super::Pin>,
    added: &'a mut Vec<Digest>,
    progress: &'a mut dyn FnMut(Progress),
}

impl TextLayers<'_> {
    /// Writes `data` as a blob and adds it; `replace` drops layers of the same type first.
    fn add(&mut self, media_type: &str, data: &[u8], replace: bool) -> Result<(), StoreError> {
        if !self.store.has_blob(&Digest::of(data)) {
            self.added.push(Digest::of(data));
        }
        let (digest, size, pin) = self.store.write_blob_pinned(data, None)?;
        self.pins.push(pin);
        (self.progress)(Progress::step(&format!("creating new layer {digest}")));
        if replace {
            self.layers.retain(|l| l.media_type != media_type);
        }
        self.layers.push(Layer { media_type: media_type.to_owned(), digest, size, from: None });
        Ok(())
    }
}

fn check_kind(info: &ModelInfo, expected: ModelKind, what: &str) -> Result<(), StoreError> {
    let found = info.kind();
    if found == expected {
        return Ok(());
    }
    let name = |k: ModelKind| match k {
        ModelKind::Model => "a model",
        ModelKind::Projector => "a projector",
        ModelKind::Adapter => "an adapter",
    };
    Err(StoreError::Invalid(format!("{what} is {}, expected {}", name(found), name(expected))))
}

/// A model's facts from its GGUF metadata, as read; `what` names the file in errors.
/// The GGUF metadata of `file` (read buffered, only the header); `what` names it in errors.
fn model_info(file: impl std::io::Read + std::io::Seek, what: &str) -> Result<ModelInfo, StoreError> {
    let gguf = |e: &dyn std::fmt::Display| StoreError::Gguf { what: what.to_owned(), message: e.to_string() };
    let read = GgufFile::read_seekable(std::io::BufReader::with_capacity(64 << 10, file));
    ModelInfo::from_file(&read.map_err(|e| gguf(&e))?).map_err(|e| gguf(&e))
}

/// The last component of a file's path, as a layer's `from` and in progress.
fn file_name(path: &Path) -> Option<String> {
    path.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Reports a file's way into the store as `copying <name>` (or `checking <name>` while it
/// is only hashed, to see whether the store has it) with its bytes, as often as a
/// [`Throttle`] lets it.
fn reading<'a>(name: &str, progress: &'a mut dyn FnMut(Progress)) -> impl FnMut(&str, u64, u64) + 'a {
    let name = name.to_owned();
    let mut throttle = Throttle::default();
    move |doing, done, total| {
        if throttle.due(done, total) {
            let status = format!("{doing} {name}");
            progress(Progress { status, digest: None, total: Some(total), completed: Some(done) });
        }
    }
}

/// A parameter count as Ollama shows it: `225.86K`, `137M`, `3.2B`.
#[must_use]
pub fn human_count(n: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "a rounded figure for people")]
    let f = n as f64;
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s };
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{}K", trim(format!("{:.2}", f / 1e3))),
        1_000_000..1_000_000_000 => format!("{}M", trim(format!("{:.2}", f / 1e6))),
        _ => format!("{}B", trim(format!("{:.1}", f / 1e9))),
    }
}

/// The architecture as Go (and so Ollama's config blobs) names it.
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
