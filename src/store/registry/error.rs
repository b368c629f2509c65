//! Why a pull or push failed: [`RegistryError`], and how the causes (a full disk, a TLS
//! handshake answered in plain HTTP, a chain of sources) are told apart.

use std::io;
use std::sync::Arc;

use crate::store::StoreError;
use crate::store::digest::Digest;

/// Why a pull or push failed. Each message names the registry, the model or blob and what
/// went wrong. Cheap to clone, so that every pull sharing a download gets the same error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RegistryError {
    /// The registry does not have the model (or one of its blobs).
    #[error("{what} not found on registry {registry}")]
    NotFound {
        /// The registry host.
        registry: String,
        /// `model <repo>:<tag>` or `blob <digest> of <repo>:<tag>`.
        what: String,
    },
    /// The registry refused access, even after the token exchange.
    #[error("registry {registry} refused access to {what}: {reason}")]
    Unauthorized {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// Why, as far as the registry or its token service said.
        reason: String,
    },
    /// The registry failed (a 5xx answer).
    #[error("registry {registry} failed with HTTP {status} for {what}: {body}")]
    Server {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body.
        body: String,
    },
    /// Any other answer the protocol does not expect.
    #[error("registry {registry} answered HTTP {status} for {what}: {body}")]
    UnexpectedStatus {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body.
        body: String,
    },
    /// An HTTPS request was answered in plain HTTP: the registry serves only HTTP, which
    /// the client must allow (rustls reports it as an invalid TLS content type).
    #[error(
        "registry {registry} answered in plain HTTP, not HTTPS, for {what}: if it serves only HTTP, \
         use --insecure (`\"insecure\": true` in the API)"
    )]
    PlainHttp {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
    },
    /// The registry could not be reached or the request failed before an answer.
    #[error("cannot reach registry {registry} for {what}: {detail}")]
    Transport {
        /// The registry host.
        registry: String,
        /// What was asked for.
        what: String,
        /// The cause, with its chain.
        detail: String,
    },
    /// A blob's transfer broke off (connection closed or reset, or stalled) before all of it
    /// arrived. What did arrive is kept for the next attempt.
    #[error(
        "the download of {what} from registry {registry} broke off after {received} of {expected} bytes \
         (range {first}-{last}): {detail}; what arrived is kept and a new pull resumes from there"
    )]
    Truncated {
        /// The registry host.
        registry: String,
        /// `blob <digest> of <repo>:<tag>`.
        what: String,
        /// Bytes that arrived in the attempt that broke off.
        received: u64,
        /// Bytes that attempt asked for.
        expected: u64,
        /// The first byte asked for.
        first: u64,
        /// The last byte asked for.
        last: u64,
        /// The cause.
        detail: String,
    },
    /// A downloaded blob's data does not hash to its digest. It was deleted.
    #[error(
        "blob {digest} from registry {registry} is corrupt: its data hashes to {actual}; \
         the download was deleted, pull again"
    )]
    DigestMismatch {
        /// The registry host.
        registry: String,
        /// The digest the manifest names.
        digest: Digest,
        /// What the data hashed to.
        actual: Digest,
    },
    /// The manifest is not one this store can use.
    #[error("registry {registry} sent a bad manifest for {model}: {reason}")]
    BadManifest {
        /// The registry host.
        registry: String,
        /// `<repo>:<tag>`.
        model: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A ranged request was answered with the wrong status, `Content-Range` or length.
    #[error("registry {registry} answered a ranged request for {what} wrongly: {detail}")]
    BadRange {
        /// The registry host.
        registry: String,
        /// `blob <digest> of <repo>:<tag>`.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// The registry broke the protocol in some other way (no upload location, a token realm
    /// that is not a URL...).
    #[error("registry {registry}: {detail}")]
    Protocol {
        /// The registry host.
        registry: String,
        /// What was wrong.
        detail: String,
    },
    /// The disk holding the store is full. Nothing half-written was kept.
    #[error("the disk is full: {context}; free some space and try again")]
    DiskFull {
        /// What could not be written, and where.
        context: String,
    },
    /// A pull waited on a download that stopped without a result.
    #[error("the download of blob {digest} stopped unexpectedly; try again")]
    Interrupted {
        /// The blob.
        digest: Digest,
    },
    /// The store failed.
    #[error(transparent)]
    Store(Arc<StoreError>),
    /// A file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The cause.
        source: Arc<io::Error>,
    },
    /// The HTTP client could not be set up.
    #[error("cannot set up the HTTP client: {0}")]
    Client(String),
}

impl RegistryError {
    /// Whether trying the same transfer again may help.
    pub(super) fn is_transient(&self) -> bool {
        matches!(self, Self::Truncated { .. } | Self::Transport { .. } | Self::Server { .. })
    }

    /// Whether the partial download must go (its data is wrong, or it holds space the disk lacks).
    pub(super) fn discards_partial(&self) -> bool {
        matches!(self, Self::DigestMismatch { .. } | Self::DiskFull { .. })
    }

    pub(super) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io { context: context.into(), source: Arc::new(source) }
    }
}

impl From<StoreError> for RegistryError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Io { context, source } if is_disk_full(&source) => Self::DiskFull { context },
            other => Self::Store(Arc::new(other)),
        }
    }
}

pub(super) fn is_disk_full(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// An error and its causes, `: `-separated.
pub(super) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether a TLS handshake failed because the server answered in plain HTTP: its first
/// byte (`H` of `HTTP/1.1`) is no TLS record type.
pub(super) fn answered_in_plain_http(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(cause) = source {
        if let Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) = cause.downcast_ref() {
            return true;
        }
        // An io::Error's `source` skips the error it wraps: look at that one too.
        if let Some(inner) = cause.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            if answered_in_plain_http(inner) {
                return true;
            }
        }
        source = cause.source();
    }
    false
}
