//! Caps on the blobs the store reads whole and parses: a model's text layers (template,
//! system prompt, licenses), its JSON layers (parameters, messages) and its config blob.
//! Their sizes come from outside (a registry's manifest, a client's create request, a
//! file someone put in the store), so each is checked twice: the size a manifest
//! declares, before anything is downloaded or written, and the bytes actually read,
//! which never go past the cap whatever the file on disk holds.
//!
//! | what                                   | cap   | real models            |
//! |----------------------------------------|-------|------------------------|
//! | a template, system prompt or license   | 1 MiB | templates under 20 KB, licenses under 40 KB |
//! | the parameters or messages JSON        | 1 MiB | under 1 KB; a few KB of messages |
//! | the config blob                        | 1 MiB | under 2 KB             |
//! | all of the above of one model together | 4 MiB | under 100 KB           |
//! | a manifest                             | 4 MiB | under 2 KB             |
//! | the adapters, the licenses a create adds | 64 each | one or two           |
//!
//! Weights, projectors and adapters are never read whole (the GGUF reader has its own
//! limits), and layers of kinds corral does not know are stored but never read.

use std::fs::File;
use std::io::{self, Read};

use super::digest::Digest;
use super::manifest::{self, Layer, Manifest};

/// The most bytes of one template, system prompt or license layer.
pub const TEXT_LAYER_MAX: u64 = 1 << 20;
/// The most bytes of one parameters or messages layer (JSON).
pub const JSON_LAYER_MAX: u64 = 1 << 20;
/// The most bytes of a config blob.
pub const CONFIG_MAX: u64 = 1 << 20;
/// The most bytes of one fact a config blob gives listings (family, parameter count,
/// quantization, format, OS, architecture; real ones are a word), and the most families
/// it may name: every listing (`/api/tags`, D-Bus) carries them for every model.
pub const CONFIG_FACT_MAX: usize = 256;
/// See [`CONFIG_FACT_MAX`].
pub const CONFIG_FAMILIES_MAX: usize = 16;
/// The most bytes of all the small blobs above of one model together.
pub const MODEL_SMALL_BLOBS_MAX: u64 = 4 << 20;
/// The most bytes of a manifest, from a registry or on disk.
pub const MANIFEST_MAX: u64 = 4 << 20;
/// The most adapters, and the most licenses, a create gives a model: each is a layer
/// written (and an adapter's header read) before the manifest, so their number is bounded
/// before anything is written, not only the bytes they come to.
pub const LAYERS_OF_A_KIND_MAX: usize = 64;

/// A blob the store reads whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmallBlob {
    /// A Go chat template.
    Template,
    /// A system prompt.
    System,
    /// A license text.
    License,
    /// Default options (JSON).
    Params,
    /// Preset messages (JSON).
    Messages,
    /// The config blob (JSON).
    Config,
}

impl SmallBlob {
    /// The kind of a layer with `media_type`; `None` for layers never read whole.
    #[must_use]
    pub fn of_layer(media_type: &str) -> Option<Self> {
        Some(match media_type {
            manifest::TEMPLATE => Self::Template,
            manifest::SYSTEM => Self::System,
            manifest::LICENSE => Self::License,
            manifest::PARAMS => Self::Params,
            manifest::MESSAGES => Self::Messages,
            _ => return None,
        })
    }

    /// The most bytes one blob of this kind may hold.
    #[must_use]
    pub const fn limit(self) -> u64 {
        match self {
            Self::Template | Self::System | Self::License => TEXT_LAYER_MAX,
            Self::Params | Self::Messages => JSON_LAYER_MAX,
            Self::Config => CONFIG_MAX,
        }
    }

    /// What it is called in messages.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Template => "template",
            Self::System => "system prompt",
            Self::License => "license",
            Self::Params => "parameters",
            Self::Messages => "messages",
            Self::Config => "config",
        }
    }
}

/// Something bigger than its cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is {} ({size} bytes), more than the limit of {} for {kind}", human(*size), human(*limit))]
pub struct TooLarge {
    /// What is too big (a layer and its digest), without paths.
    pub what: String,
    /// What the limit is about (`a license layer`).
    pub kind: String,
    /// Its size in bytes (at least this many when it was read, not declared).
    pub size: u64,
    /// The limit in bytes.
    pub limit: u64,
}

/// `1 MiB` for a whole number of units, else `1.0 MiB`.
fn human(bytes: u64) -> String {
    for (unit, name) in [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{} {name}", bytes / unit);
        }
    }
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

impl TooLarge {
    fn layer(kind: SmallBlob, digest: &Digest, size: u64) -> Self {
        Self {
            what: format!("the {} layer {digest}", kind.name()),
            kind: format!("a {} layer", kind.name()),
            size,
            limit: kind.limit(),
        }
    }

    /// The manifest of a create, over [`MANIFEST_MAX`].
    pub(super) fn manifest(name: &str, size: u64) -> Self {
        Self { what: format!("the manifest of {name}"), kind: "a manifest".to_owned(), size, limit: MANIFEST_MAX }
    }

    pub(super) fn total(size: u64) -> Self {
        Self {
            what: "the text, JSON and config layers of the model".to_owned(),
            kind: "one model's text, JSON and config layers together".to_owned(),
            size,
            limit: MODEL_SMALL_BLOBS_MAX,
        }
    }
}

/// The small blobs of a manifest with their kinds: the config first, then the layers.
pub fn small_blobs(manifest: &Manifest) -> impl Iterator<Item = (SmallBlob, &Layer)> + '_ {
    std::iter::once((SmallBlob::Config, manifest.config()))
        .chain(manifest.layers().iter().filter_map(|l| SmallBlob::of_layer(&l.media_type).map(|k| (k, l))))
}

/// Checks the sizes a manifest declares for its small blobs against their caps, one by
/// one and together: a pull or create refuses a manifest that fails, before it stores
/// anything.
pub fn check_manifest(manifest: &Manifest) -> Result<(), TooLarge> {
    let mut total = 0u64;
    for (kind, layer) in small_blobs(manifest) {
        if layer.size > kind.limit() {
            return Err(TooLarge::layer(kind, &layer.digest, layer.size));
        }
        total = total.saturating_add(layer.size);
    }
    if total > MODEL_SMALL_BLOBS_MAX {
        return Err(TooLarge::total(total));
    }
    Ok(())
}

/// Checks data about to become a small blob of `kind` (in a create).
pub fn check_data(kind: SmallBlob, data: &[u8]) -> Result<(), TooLarge> {
    let size = data.len() as u64;
    if size > kind.limit() {
        return Err(TooLarge {
            what: format!("the {}", kind.name()),
            kind: format!("a {} layer", kind.name()),
            size,
            limit: kind.limit(),
        });
    }
    Ok(())
}

/// Why a capped read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Reading failed.
    #[error("cannot read the file: {0}")]
    Read(#[source] io::Error),
    /// The file holds more than the cap.
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
}

/// Reads the whole of `file` (opened through the store, which refuses links, FIFOs and
/// devices) if it holds at most `limit` bytes; a bigger one is an error, and no more than
/// `limit + 1` bytes of it are read. `what` and `kind` name it in that error.
pub fn read_capped(file: File, limit: u64, what: &str, kind: &str) -> Result<Vec<u8>, ReadError> {
    let declared = file.metadata().map_or(0, |m| m.len());
    let too_large =
        |size: u64| TooLarge { what: what.to_owned(), kind: kind.to_owned(), size: size.max(declared), limit };
    if declared > limit {
        return Err(too_large(declared).into());
    }
    // The length from `metadata` is a hint: the file may grow while read.
    let mut bytes = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(ReadError::Read)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64).into());
    }
    Ok(bytes)
}

/// Reads a model's small blob of `kind` from `file`, charging it to `budget`, the bytes
/// the model's small blobs may still take together.
pub fn read_small_blob(file: File, kind: SmallBlob, digest: &Digest, budget: &mut u64) -> Result<Vec<u8>, ReadError> {
    let bytes = match read_capped(file, kind.limit().min(*budget), "", "") {
        Ok(bytes) => bytes,
        Err(ReadError::TooLarge(e)) if e.size > kind.limit() => {
            return Err(TooLarge::layer(kind, digest, e.size).into());
        }
        Err(ReadError::TooLarge(e)) => {
            // Within its own cap: the model's small blobs together are too large.
            let used = MODEL_SMALL_BLOBS_MAX.saturating_sub(*budget);
            return Err(TooLarge::total(used.saturating_add(e.size)).into());
        }
        Err(e) => return Err(e),
    };
    *budget = budget.saturating_sub(bytes.len() as u64);
    Ok(bytes)
}

#[cfg(test)]
mod tests {

    use super::{
        CONFIG_MAX, MODEL_SMALL_BLOBS_MAX, ReadError, SmallBlob, TEXT_LAYER_MAX, check_data, check_manifest,
        read_capped, read_small_blob,
    };
    use crate::store::digest::Digest;
    use crate::store::manifest::{self, Layer, Manifest};

    fn layer(media_type: &str, size: u64) -> Layer {
        Layer { media_type: media_type.into(), digest: Digest::of(media_type.as_bytes()), size, from: None }
    }

    fn manifest(config: u64, layers: &[(&str, u64)]) -> Manifest {
        let mut all = vec![layer(manifest::MODEL, 10 << 30)];
        all.extend(layers.iter().map(|(t, s)| layer(t, *s)));
        Manifest::new(layer(manifest::CONFIG_MEDIA_TYPE, config), all).expect("weights")
    }

    #[test]
    fn declared_sizes_are_checked_per_kind_and_together() {
        // Weights and unknown kinds have no cap; every small kind has one.
        check_manifest(&manifest(500, &[(manifest::TEMPLATE, 20_000), ("application/x-other", 1 << 40)]))
            .expect("a real model");
        check_manifest(&manifest(CONFIG_MAX, &[(manifest::LICENSE, TEXT_LAYER_MAX)])).expect("at the caps");
        for media_type in
            [manifest::TEMPLATE, manifest::SYSTEM, manifest::LICENSE, manifest::PARAMS, manifest::MESSAGES]
        {
            let err = check_manifest(&manifest(10, &[(media_type, 200 << 20)])).expect_err(media_type);
            let kind = SmallBlob::of_layer(media_type).expect("small");
            assert!(err.to_string().starts_with(&format!("the {} layer sha256:", kind.name())), "{err}");
            assert!(err.to_string().contains("200 MiB (209715200 bytes), more than the limit of 1 MiB"), "{err}");
        }
        let err = check_manifest(&manifest(CONFIG_MAX + 1, &[])).expect_err("config");
        assert!(err.to_string().contains("the config layer"), "{err}");
        let many = vec![(manifest::LICENSE, TEXT_LAYER_MAX); 4];
        let err = check_manifest(&manifest(1, &many)).expect_err("together");
        assert_eq!(err.limit, MODEL_SMALL_BLOBS_MAX);
        assert!(err.to_string().contains("the text, JSON and config layers of the model"), "{err}");
    }

    #[test]
    fn data_for_a_new_layer_is_checked() {
        check_data(SmallBlob::System, &vec![b'x'; 1 << 20]).expect("at the cap");
        let err = check_data(SmallBlob::System, &vec![b'x'; (1 << 20) + 1]).expect_err("over");
        assert!(
            err.to_string().starts_with("the system prompt is 1.0 MiB (1048577 bytes), more than the limit of 1 MiB"),
            "{err}"
        );
    }

    #[test]
    fn reads_stop_at_the_cap() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("blob");
        std::fs::write(&path, b"small").expect("write");
        let open = |p: &std::path::Path| std::fs::File::open(p).expect("open");
        assert_eq!(read_capped(open(&path), 5, "x", "y").expect("read"), b"small");
        let err = read_capped(open(&path), 4, "the blob", "a blob").expect_err("over");
        assert!(matches!(&err, ReadError::TooLarge(e) if e.size == 5 && e.limit == 4), "{err}");

        // A sparse file of 1 GiB: refused from its length, without reading it.
        let big = dir.path().join("big");
        let file = std::fs::File::create(&big).expect("create");
        file.set_len(1 << 30).expect("grow");
        let err = read_capped(open(&big), TEXT_LAYER_MAX, "the big one", "a license layer").expect_err("big");
        assert!(err.to_string().contains("the big one is 1 GiB (1073741824 bytes)"), "{err}");
    }

    #[test]
    fn a_models_small_blobs_share_one_budget() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("blob");
        std::fs::write(&path, vec![b'x'; 1000]).expect("write");
        let digest = Digest::of(b"x");
        let mut budget = 2500;
        for _ in 0..2 {
            read_small_blob(std::fs::File::open(&path).expect("open"), SmallBlob::License, &digest, &mut budget)
                .expect("within");
        }
        assert_eq!(budget, 500);
        let err = read_small_blob(std::fs::File::open(&path).expect("open"), SmallBlob::License, &digest, &mut budget)
            .expect_err("over");
        assert!(err.to_string().contains("text, JSON and config layers of the model"), "{err}");
    }
}
