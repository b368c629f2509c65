//! One repository on a registry, as one pull or push speaks the OCI distribution protocol
//! to it: its URLs, the errors its answers mean, the manifest fetched and checked against
//! the digest the registry announces. Requests go through [`Remote::send`] (in `auth.rs`),
//! which adds the token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use reqwest::header::ACCEPT;
use reqwest::{Client, Response, StatusCode, Url};

use super::error::{answered_in_plain_http, chain};
use super::{Inner, RegistryConfig, RegistryError};
use crate::store::digest::Digest;
use crate::store::manifest::MANIFEST_MEDIA_TYPE;
use crate::store::name::ModelName;

/// The most a manifest may weigh; real ones are a few KB.
const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// How much of an error answer's body goes into an error message.
pub(super) const EXCERPT_BYTES: usize = 300;

/// One registry repository, as seen by one pull or push: where it is and the token to use.
#[derive(Debug)]
pub(super) struct Remote {
    pub(super) inner: Arc<Inner>,
    /// `host[:port]`.
    pub(super) registry: String,
    /// `<repo>:<tag>`, for messages.
    pub(super) model: String,
    /// `<scheme>://<host>/v2/<repo>/`.
    pub(super) base: Url,
    pub(super) token: Mutex<Option<String>>,
    /// Whether blob parts are read by `plain_http` (a registry spoken to over plain HTTP),
    /// until the registry redirects one elsewhere.
    read_direct: AtomicBool,
}

impl Inner {
    pub(super) fn remote(self: &Arc<Self>, name: &ModelName) -> Result<Remote, RegistryError> {
        let registry = name.registry().to_owned();
        let insecure = self.config.insecure.iter().any(|h| h.eq_ignore_ascii_case(&registry));
        let scheme = if insecure { "http" } else { "https" };
        let base = format!("{scheme}://{registry}/v2/{}/", name.repository());
        let base = Url::parse(&base).map_err(|e| RegistryError::Protocol {
            registry: registry.clone(),
            detail: format!("cannot make a URL of {base}: {e}"),
        })?;
        Ok(Remote {
            inner: Arc::clone(self),
            model: format!("{}:{}", name.repository(), name.tag()),
            registry,
            base,
            token: Mutex::default(),
            read_direct: AtomicBool::new(insecure),
        })
    }
}

impl Remote {
    pub(super) fn client(&self) -> Result<&Client, RegistryError> {
        self.inner.client()
    }

    pub(super) fn upload_client(&self) -> Result<&Client, RegistryError> {
        self.inner.upload_client()
    }

    pub(super) fn config(&self) -> &RegistryConfig {
        &self.inner.config
    }

    pub(super) fn url(&self, rest: &str) -> Result<Url, RegistryError> {
        let url = format!("{}{rest}", self.base);
        Url::parse(&url).map_err(|e| RegistryError::Protocol {
            registry: self.registry.clone(),
            detail: format!("cannot make a URL of {url}: {e}"),
        })
    }

    /// A request that got no answer: a plain-HTTP answer to HTTPS is named as such.
    pub(super) fn transport(&self, what: String, error: &reqwest::Error) -> RegistryError {
        if answered_in_plain_http(error) {
            return RegistryError::PlainHttp { registry: self.registry.clone(), what };
        }
        RegistryError::Transport { registry: self.registry.clone(), what, detail: chain(error) }
    }

    pub(super) fn unauthorized(&self, what: &str, reason: String) -> RegistryError {
        RegistryError::Unauthorized { registry: self.registry.clone(), what: what.to_owned(), reason }
    }

    /// Whether blob parts are read by `plain_http`.
    pub(super) fn reads_direct(&self) -> bool {
        self.read_direct.load(Ordering::Relaxed)
    }

    /// Leaves blob parts to the HTTP client from now on (it follows redirects).
    pub(super) fn stop_reading_direct(&self) {
        self.read_direct.store(false, Ordering::Relaxed);
    }

    /// The error for an answer the protocol does not expect.
    pub(super) async fn fail(&self, what: &str, response: Response) -> RegistryError {
        let status = response.status();
        let body = excerpt(response).await;
        self.status_error(what, status, body)
    }

    /// The error for an answer of `status` the protocol does not expect, `body` the start
    /// of its body ([`excerpt_text`]).
    pub(super) fn status_error(&self, what: &str, status: StatusCode, body: String) -> RegistryError {
        let (registry, what) = (self.registry.clone(), what.to_owned());
        match status.as_u16() {
            404 => RegistryError::NotFound { registry, what },
            401 | 403 => RegistryError::Unauthorized { registry, what, reason: format!("HTTP {status}: {body}") },
            500..=599 => RegistryError::Server { registry, what, status: status.as_u16(), body },
            code => RegistryError::UnexpectedStatus { registry, what, status: code, body },
        }
    }

    /// The answer if its status is one of `ok`, else the error for it.
    pub(super) async fn expect(
        &self,
        what: &str,
        response: Response,
        ok: &[StatusCode],
    ) -> Result<Response, RegistryError> {
        if ok.contains(&response.status()) { Ok(response) } else { Err(self.fail(what, response).await) }
    }

    /// The manifest's bytes, as the registry sent them.
    pub(super) async fn manifest(&self) -> Result<Vec<u8>, RegistryError> {
        let what = format!("model {}", self.model);
        let tag = self.model.rsplit_once(':').map_or("latest", |(_, tag)| tag);
        let url = self.url(&format!("manifests/{tag}"))?;
        let response = self
            .send(&what, || {
                Ok(self
                    .client()?
                    .get(url.clone())
                    .header(ACCEPT, MANIFEST_MEDIA_TYPE)
                    .timeout(self.config().request_timeout))
            })
            .await?;
        let response = self.expect(&what, response, &[StatusCode::OK]).await?;
        let announced = response
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| Digest::parse(v).ok());
        let bad = |reason: String| RegistryError::BadManifest {
            registry: self.registry.clone(),
            model: self.model.clone(),
            reason,
        };
        let bytes = read_capped(response, MAX_MANIFEST_BYTES).await.map_err(bad)?;
        if let Some(announced) = announced {
            let actual = Digest::of(&bytes);
            if announced != actual {
                return Err(bad(format!("the registry says its digest is {announced}, but it hashes to {actual}")));
            }
        }
        Ok(bytes)
    }
}

/// The start of an answer's body, on one line, for an error message.
pub(super) async fn excerpt(mut response: Response) -> String {
    let mut data = Vec::new();
    while data.len() <= EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => data.extend_from_slice(&chunk),
            _ => break,
        }
    }
    excerpt_text(&data)
}

/// [`EXCERPT_BYTES`] of `data`, the start of a body, on one line (`…` where more came).
pub(super) fn excerpt_text(data: &[u8]) -> String {
    let cut = data.len() > EXCERPT_BYTES;
    let text = String::from_utf8_lossy(&data[..data.len().min(EXCERPT_BYTES)]);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.is_empty() {
        "(empty body)".to_owned()
    } else if cut {
        format!("{text}…")
    } else {
        text
    }
}

/// A whole body of at most `max` bytes.
pub(super) async fn read_capped(mut response: Response, max: usize) -> Result<Vec<u8>, String> {
    let mut data = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| chain(&e))? {
        data.extend_from_slice(&chunk);
        if data.len() > max {
            return Err(format!("the answer is larger than {max} bytes"));
        }
    }
    Ok(data)
}
