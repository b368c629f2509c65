//! What a long store operation (pull, push, create) reports as it goes, in the shape of
//! Ollama's streamed `/api/pull` and `/api/create` lines.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::digest::Digest;

/// How often progress is reported while bytes flow.
pub(super) const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// One progress event of a pull, push or create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// What is happening: `pulling manifest`, `pulling <12 hex digits>`, `verifying sha256
    /// digest`, `writing manifest`, `success`; for a push `retrieving manifest`, `pushing <12
    /// hex digits>`, `pushing manifest`, `success`; for a create `copying <file name>`,
    /// `parsing GGUF`, `creating new layer <digest>`, ….
    pub status: String,
    /// The blob being transferred (none while a file is copied: its digest is known at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<Digest>,
    /// The blob's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// How much of it is in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<u64>,
}

impl Progress {
    /// A step with no blob attached.
    #[must_use]
    pub fn step(status: &str) -> Self {
        Self { status: status.to_owned(), digest: None, total: None, completed: None }
    }

    /// A blob transfer: `<verb> <12 hex digits of the digest>`.
    #[must_use]
    pub fn blob(verb: &str, digest: Digest, total: u64, completed: u64) -> Self {
        Self {
            status: format!("{verb} {}", &digest.hex()[..12]),
            digest: Some(digest),
            total: Some(total),
            completed: Some(completed),
        }
    }
}
