//! Why a store operation failed, and the helpers that turn the file system's errors into
//! [`StoreError`]s naming the entry.

use std::io;

use super::beneath;
use super::digest::Digest;
use super::limits;
use super::manifest::ManifestError;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No manifest by that name.
    #[error("model '{0}' not found")]
    NotFound(String),
    /// The destination of a copy or create already exists (when that matters).
    #[error("model '{0}' already exists")]
    Exists(String),
    /// Data did not match the digest it was announced with.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The announced digest.
        expected: Digest,
        /// What the data hashed to.
        actual: Digest,
    },
    /// A file is not a usable GGUF.
    #[error("{what} is not a usable GGUF file: {message}")]
    Gguf {
        /// The file or blob.
        what: String,
        /// What the reader found.
        message: String,
    },
    /// A request makes no sense (a wrong kind of file, a bad reference).
    #[error("{0}")]
    Invalid(String),
    /// A manifest refers to a blob the store does not have.
    #[error("blob {0} is missing from the store")]
    MissingBlob(Digest),
    /// A manifest in the store or from a registry is malformed.
    #[error("{name}: {source}")]
    Manifest {
        /// Whose manifest.
        name: String,
        /// What is wrong.
        source: ManifestError,
    },
    /// An entry of the store is not what the store keeps there: a symbolic link (never
    /// followed), or a FIFO or device where a file belongs. It is left alone.
    #[error("refusing {path} in the model store: {reason}")]
    Refused {
        /// The entry, relative to the store's root.
        path: String,
        /// What it is.
        reason: &'static str,
    },
    /// A blob or manifest is bigger than the store reads (see [`limits`]).
    #[error(transparent)]
    TooLarge(#[from] limits::TooLarge),
    /// The file system failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The cause.
        source: io::Error,
    },
}

pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

/// The error for `action` on `path` (relative to the store's root): a refusal when the
/// entry is a link or of the wrong kind, else the file system's error.
pub(super) fn fs_err(action: &str, path: String) -> impl FnOnce(io::Error) -> StoreError {
    let action = action.to_owned();
    move |source| match beneath::refusal(&source) {
        Some(refusal) => StoreError::Refused { path, reason: refusal.reason() },
        None => StoreError::Io { context: format!("cannot {action} {path} in the model store"), source },
    }
}

/// Whether an entry went away (or never was): a concurrent delete, not a failure.
pub(super) fn vanished(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::NotFound
}
