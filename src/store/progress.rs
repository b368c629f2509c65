//! What a long store operation (pull, push, create) reports as it goes, in the shape of
//! Ollama's streamed `/api/pull` and `/api/create` lines.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::digest::Digest;

/// How often progress is reported while bytes flow.
pub(super) const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// When a transfer's progress is worth reporting: the first time, then at most every
/// [`PROGRESS_INTERVAL`], and always at its end.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    reported: Option<Instant>,
}

impl Throttle {
    /// Whether `done` of `total` bytes is to be reported now (counted as reported if so).
    pub(super) fn due(&mut self, done: u64, total: u64) -> bool {
        let due = done == total || self.reported.is_none_or(|at| at.elapsed() >= PROGRESS_INTERVAL);
        if due {
            self.reported = Some(Instant::now());
        }
        due
    }
}

/// One progress event of a pull, push or create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// What is happening: `pulling manifest`, `pulling <12 hex digits>`, `verifying sha256
    /// digest`, `writing manifest`, `success`; for a push `retrieving manifest`, `pushing <12
    /// hex digits>`, `pushing manifest`, `success`; for a create `parsing GGUF`, `checking
    /// <file name>` and `copying <file name>`, `creating new layer <digest>`, ….
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
