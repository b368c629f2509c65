//! Manifests and config blobs in the shape Ollama and its registry use (Docker
//! distribution manifest v2 with `application/vnd.ollama.image.*` layers).

use serde::{Deserialize, Serialize};

use super::digest::Digest;

/// The manifest media type.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// The config blob's media type.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.docker.container.image.v1+json";
/// GGUF weights.
pub const MODEL: &str = "application/vnd.ollama.image.model";
/// A multimodal projector.
pub const PROJECTOR: &str = "application/vnd.ollama.image.projector";
/// A LoRA adapter.
pub const ADAPTER: &str = "application/vnd.ollama.image.adapter";
/// A Go chat template.
pub const TEMPLATE: &str = "application/vnd.ollama.image.template";
/// The system prompt.
pub const SYSTEM: &str = "application/vnd.ollama.image.system";
/// Default options as JSON.
pub const PARAMS: &str = "application/vnd.ollama.image.params";
/// A license text.
pub const LICENSE: &str = "application/vnd.ollama.image.license";
/// Preset messages as JSON.
pub const MESSAGES: &str = "application/vnd.ollama.image.messages";

/// A manifest: the config blob and the layers, each by digest. It always has a weights layer:
/// both ways to make one ([`Manifest::new`], [`Manifest::parse`]) refuse layers without, and
/// nothing changes it after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Always 2.
    schema_version: u32,
    /// [`MANIFEST_MEDIA_TYPE`].
    media_type: String,
    /// The config blob.
    config: Layer,
    /// The layers, in order.
    layers: Vec<Layer>,
    /// Where in `layers` the weights are: the first [`MODEL`] layer.
    #[serde(skip)]
    model: usize,
}

/// A manifest as it is written, before it is checked.
#[derive(Deserialize)]
#[serde(rename = "Manifest", rename_all = "camelCase")]
struct Unchecked {
    schema_version: u32,
    media_type: String,
    config: Layer,
    layers: Vec<Layer>,
}

/// One blob a manifest refers to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Layer {
    /// What the blob holds.
    pub media_type: String,
    /// Its digest.
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// Where it came from (a file name or model), as Ollama records it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
}

/// The config blob: model facts for listings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `gguf`.
    #[serde(default)]
    pub model_format: String,
    /// The architecture family (`llama`).
    #[serde(default)]
    pub model_family: String,
    /// Families, the model's first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_families: Option<Vec<String>>,
    /// The parameter count, as Ollama shows it (`3.2B`).
    #[serde(default)]
    pub model_type: String,
    /// The quantization (`Q4_K_M`, `F16`).
    #[serde(default)]
    pub file_type: String,
    /// `linux` etc.; Ollama writes the builder's OS.
    #[serde(default)]
    pub os: String,
    /// `amd64` etc.
    #[serde(default)]
    pub architecture: String,
    /// The layer digests.
    #[serde(default)]
    pub rootfs: RootFs,
}

/// `rootfs` of the config blob.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFs {
    /// `layers`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The layers' digests.
    #[serde(default)]
    pub diff_ids: Vec<Digest>,
}

/// Why a manifest is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not JSON, or not a manifest.
    #[error("invalid manifest: {0}")]
    Json(#[from] serde_json::Error),
    /// A manifest of another kind.
    #[error("unsupported manifest: schema version {schema}, media type {media_type}")]
    Unsupported {
        /// Its schema version.
        schema: u32,
        /// Its media type.
        media_type: String,
    },
    /// No GGUF weights layer.
    #[error("the manifest has no model layer ({MODEL})")]
    NoModel,
    /// More layers than a model has, in all or of one media type.
    #[error("the manifest lists {count} {what}; a model has at most {limit}")]
    TooManyLayers {
        /// `layers`, or `layers of <media type>`.
        what: String,
        /// How many it lists.
        count: usize,
        /// The most a manifest may list.
        limit: usize,
    },
}

/// The most layers of one media type a manifest lists: each is a blob to fetch, and an
/// adapter one more argument of the runner's command line. As many as a create gives a
/// model ([`super::limits::LAYERS_OF_A_KIND_MAX`]).
pub const LAYERS_OF_A_TYPE_MAX: usize = super::limits::LAYERS_OF_A_KIND_MAX;

/// The most layers a manifest lists in all.
pub const LAYERS_MAX: usize = 4 * LAYERS_OF_A_TYPE_MAX;

impl Manifest {
    /// Parses and checks a manifest: schema 2, the v2 media type, one model layer.
    pub fn parse(bytes: &[u8]) -> Result<Self, ManifestError> {
        let manifest: Unchecked = serde_json::from_slice(bytes)?;
        if manifest.schema_version != 2 || manifest.media_type != MANIFEST_MEDIA_TYPE {
            return Err(ManifestError::Unsupported {
                schema: manifest.schema_version,
                media_type: manifest.media_type,
            });
        }
        Self::new(manifest.config, manifest.layers)
    }

    /// A new manifest, which needs a weights layer among `layers`, and at most
    /// [`LAYERS_MAX`] of them, [`LAYERS_OF_A_TYPE_MAX`] of each media type.
    pub fn new(config: Layer, layers: Vec<Layer>) -> Result<Self, ManifestError> {
        let too_many = |what: String, count| ManifestError::TooManyLayers { what, count, limit: LAYERS_MAX };
        if layers.len() > LAYERS_MAX {
            return Err(too_many("layers".to_owned(), layers.len()));
        }
        let mut counts = std::collections::HashMap::new();
        for layer in &layers {
            let count = counts.entry(layer.media_type.as_str()).or_insert(0);
            *count += 1;
            if *count > LAYERS_OF_A_TYPE_MAX {
                // From a registry: any length, so the message shows its start.
                let kind: String = layer.media_type.chars().take(100).collect();
                let count = layers.iter().filter(|l| l.media_type == layer.media_type).count();
                return Err(ManifestError::TooManyLayers {
                    what: format!("layers of {kind}"),
                    count,
                    limit: LAYERS_OF_A_TYPE_MAX,
                });
            }
        }
        let model = layers.iter().position(|l| l.media_type == MODEL).ok_or(ManifestError::NoModel)?;
        Ok(Self { schema_version: 2, media_type: MANIFEST_MEDIA_TYPE.to_owned(), config, layers, model })
    }

    /// Serialized as the store and registries keep it.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serializes")
    }

    /// The weights layer.
    #[must_use]
    pub fn model(&self) -> &Layer {
        &self.layers[self.model]
    }

    /// The config blob.
    #[must_use]
    pub fn config(&self) -> &Layer {
        &self.config
    }

    /// The layers, in order.
    #[must_use]
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The schema version: always 2.
    #[must_use]
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }

    /// The media type: always [`MANIFEST_MEDIA_TYPE`].
    #[must_use]
    pub fn media_type(&self) -> &str {
        &self.media_type
    }

    /// Every blob: the layers, then the config.
    pub fn blobs(&self) -> impl Iterator<Item = &Layer> + '_ {
        self.layers.iter().chain(std::iter::once(&self.config))
    }

    /// The layers of one media type, in order.
    pub fn layers_of<'a>(&'a self, media_type: &'a str) -> impl Iterator<Item = &'a Layer> + 'a {
        self.layers.iter().filter(move |l| l.media_type == media_type)
    }

    /// The total size of all blobs (saturating: the sizes come from a registry).
    #[must_use]
    pub fn size(&self) -> u64 {
        self.blobs().fold(0, |sum, l| sum.saturating_add(l.size))
    }
}

#[cfg(test)]
mod tests {
    use super::{Digest, Layer, MODEL, Manifest, ManifestError, TEMPLATE};

    fn layer(media_type: &str, data: &[u8]) -> Layer {
        Layer { media_type: media_type.into(), digest: Digest::of(data), size: data.len() as u64, from: None }
    }

    #[test]
    fn a_manifest_round_trips_in_ollamas_shape() {
        let m =
            Manifest::new(layer(super::CONFIG_MEDIA_TYPE, b"{}"), vec![layer(MODEL, b"gguf"), layer(TEMPLATE, b"t")])
                .expect("weights");
        let bytes = m.to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(json["schemaVersion"], 2);
        assert_eq!(json["mediaType"], super::MANIFEST_MEDIA_TYPE);
        assert_eq!(json["layers"][0]["mediaType"], MODEL);
        assert!(json["layers"][0]["digest"].as_str().expect("digest").starts_with("sha256:"));
        assert!(json["layers"][0].get("from").is_none());
        let back = Manifest::parse(&bytes).expect("parse");
        assert_eq!(back, m);
        assert_eq!(back.size(), 2 + 4 + 1);
        assert_eq!(back.blobs().count(), 3);
    }

    #[test]
    fn bad_manifests_are_refused() {
        assert!(matches!(Manifest::parse(b"not json"), Err(ManifestError::Json(_))));
        let (config, template) = (layer(super::CONFIG_MEDIA_TYPE, b"{}"), layer(TEMPLATE, b"t"));
        assert!(matches!(Manifest::new(config.clone(), vec![template.clone()]), Err(ManifestError::NoModel)));
        let no_model = serde_json::json!({
            "schemaVersion": 2, "mediaType": super::MANIFEST_MEDIA_TYPE, "config": config, "layers": [template],
        });
        let no_model = serde_json::to_vec(&no_model).expect("JSON");
        assert!(matches!(Manifest::parse(&no_model), Err(ManifestError::NoModel)));
        let mut v1 = Manifest::new(layer(super::CONFIG_MEDIA_TYPE, b"{}"), vec![layer(MODEL, b"m")]).expect("weights");
        v1.schema_version = 1;
        assert!(Manifest::parse(&v1.to_bytes()).expect_err("v1").to_string().contains("schema version 1"));
        let bad_digest = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","config":{"mediaType":"x","digest":"sha256:../../etc","size":1},"layers":[]}"#;
        assert!(Manifest::parse(bad_digest).expect_err("digest").to_string().contains("invalid digest"));
    }

    /// A manifest of thousands of layers (a registry's, under its 4 MiB cap) is refused
    /// before a blob is fetched: in all, and of one media type (adapters, each an argument
    /// of the runner's command line), the bounds included.
    #[test]
    fn a_manifest_of_too_many_layers_is_refused() {
        use super::{ADAPTER, LAYERS_MAX, LAYERS_OF_A_TYPE_MAX, LICENSE};
        let config = layer(super::CONFIG_MEDIA_TYPE, b"{}");
        let of = |media_type: &str, n: usize| (0..n).map(|i| layer(media_type, &i.to_le_bytes())).collect::<Vec<_>>();
        let with = |others: Vec<Layer>| [vec![layer(MODEL, b"m")], others].concat();
        let most = with([of(ADAPTER, LAYERS_OF_A_TYPE_MAX), of(LICENSE, LAYERS_OF_A_TYPE_MAX)].concat());
        assert!(Manifest::new(config.clone(), most).is_ok(), "as many as a create makes");
        let error = Manifest::new(config.clone(), with(of(ADAPTER, 20_000))).expect_err("adapters");
        assert_eq!(error.to_string(), "the manifest lists 20001 layers; a model has at most 256");
        let error = Manifest::new(config.clone(), with(of(ADAPTER, LAYERS_OF_A_TYPE_MAX + 1))).expect_err("one more");
        assert_eq!(error.to_string(), format!("the manifest lists 65 layers of {ADAPTER}; a model has at most 64"));
        let kinds: Vec<Layer> = (0..LAYERS_MAX).map(|i| layer(&format!("x/{i}"), b"l")).collect();
        let error = Manifest::new(config.clone(), with(kinds)).expect_err("layers");
        assert_eq!(error.to_string(), format!("the manifest lists {} layers; a model has at most 256", LAYERS_MAX + 1));
        // A long media type is shown by its start.
        let long = "y".repeat(5000);
        let error = Manifest::new(config, with(of(&long, LAYERS_OF_A_TYPE_MAX + 1))).expect_err("long");
        assert!(error.to_string().len() < 200, "{error}");
    }

    #[test]
    fn hostile_sizes_do_not_overflow_the_total() {
        // Found by the registry_manifest fuzz target: the sum overflowed (a panic in debug
        // builds, a wrapped size in release ones).
        let mut huge = layer(MODEL, b"m");
        huge.size = u64::MAX;
        let m = Manifest::new(layer(super::CONFIG_MEDIA_TYPE, b"{}"), vec![huge.clone(), huge]).expect("weights");
        let back = Manifest::parse(&m.to_bytes()).expect("parse");
        assert_eq!(back.size(), u64::MAX);
    }

    #[test]
    fn the_weights_are_the_first_model_layer_wherever_it_is() {
        let (weights, other) = (layer(MODEL, b"weights"), layer(MODEL, b"other"));
        let m =
            Manifest::new(layer(super::CONFIG_MEDIA_TYPE, b"{}"), vec![layer(TEMPLATE, b"t"), weights.clone(), other])
                .expect("weights");
        assert_eq!(m.model(), &weights);
        assert_eq!(Manifest::parse(&m.to_bytes()).expect("parse").model(), &weights);
    }
}
