//! The token dance: anonymous Bearer tokens, as `registry.ollama.ai` and Docker registries
//! hand them out.
//!
//! A `401` with `WWW-Authenticate: Bearer realm="…",service="…",scope="…"` makes the client
//! `GET` the realm with `service` and `scope` as query parameters, anonymously, and use the
//! `token` (or `access_token`) of the JSON answer as `Authorization: Bearer`, retrying the
//! request once; the token is reused for the rest of the pull or push. The realm must be an
//! `https` URL, or a plain `http` one on the registry's own host and port (an insecure
//! registry's own token service): a token is never fetched over plain HTTP from elsewhere.
//! Basic authentication is not supported.

use crate::sync::lock;

use reqwest::header::WWW_AUTHENTICATE;
use reqwest::{RequestBuilder, Response, StatusCode, Url};
use serde::Deserialize;

use super::RegistryError;
use super::protocol::{Remote, excerpt, read_capped};

/// The most a token service's answer may weigh.
const MAX_TOKEN_BYTES: usize = 64 << 10;

/// A token service's answer.
#[derive(Debug, Deserialize)]
struct TokenReply {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
}

impl Remote {
    /// Sends a request, with the token if there is one. On 401 with a Bearer challenge it
    /// gets a token and sends the request once more; `build` makes the request each time.
    pub(super) async fn send(
        &self,
        what: &str,
        build: impl Fn() -> Result<RequestBuilder, RegistryError>,
    ) -> Result<Response, RegistryError> {
        let mut renewed = false;
        loop {
            let mut request = build()?;
            let token = lock(&self.token).clone();
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.map_err(|e| self.transport(what.to_owned(), &e))?;
            if response.status() != StatusCode::UNAUTHORIZED {
                return Ok(response);
            }
            if renewed {
                let body = excerpt(response).await;
                return Err(
                    self.unauthorized(what, format!("HTTP 401 even with the token its token service issued: {body}"))
                );
            }
            let header = response.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let Some(challenge) = header.as_deref().and_then(Challenge::parse) else {
                let body = excerpt(response).await;
                let header = header.map_or_else(|| "none".to_owned(), |h| format!("\"{h}\""));
                return Err(self.unauthorized(
                    what,
                    format!("HTTP 401 without a Bearer challenge (WWW-Authenticate: {header}): {body}"),
                ));
            };
            let token = self.fetch_token(what, &challenge).await?;
            *lock(&self.token) = Some(token);
            renewed = true;
        }
    }

    /// Gets an anonymous token from the challenge's realm.
    async fn fetch_token(&self, what: &str, challenge: &Challenge) -> Result<String, RegistryError> {
        let realm = Url::parse(&challenge.realm).map_err(|e| {
            self.unauthorized(what, format!("its token service \"{}\" is not a URL: {e}", challenge.realm))
        })?;
        let same_host = realm.host_str() == self.base.host_str()
            && realm.port_or_known_default() == self.base.port_or_known_default();
        if realm.scheme() != "https" && !(realm.scheme() == "http" && same_host) {
            return Err(self.unauthorized(
                what,
                format!("refusing its token service {realm}: it must use HTTPS or be on the registry's own host"),
            ));
        }
        let mut url = realm.clone();
        {
            let mut query = url.query_pairs_mut();
            if let Some(service) = &challenge.service {
                query.append_pair("service", service);
            }
            if let Some(scope) = &challenge.scope {
                query.append_pair("scope", scope);
            }
        }
        let response = self
            .client()?
            .get(url)
            .timeout(self.config().request_timeout)
            .send()
            .await
            .map_err(|e| self.transport(format!("a token for {what} from {realm}"), &e))?;
        let status = response.status();
        if !status.is_success() {
            let body = excerpt(response).await;
            return Err(self.unauthorized(what, format!("its token service {realm} answered HTTP {status}: {body}")));
        }
        let bytes = read_capped(response, MAX_TOKEN_BYTES)
            .await
            .map_err(|detail| self.unauthorized(what, format!("cannot read the answer of {realm}: {detail}")))?;
        let reply: TokenReply = serde_json::from_slice(&bytes)
            .map_err(|e| self.unauthorized(what, format!("its token service {realm} sent no token JSON: {e}")))?;
        reply
            .token
            .filter(|t| !t.is_empty())
            .or(reply.access_token.filter(|t| !t.is_empty()))
            .ok_or_else(|| self.unauthorized(what, format!("its token service {realm} sent no token")))
    }
}

/// `WWW-Authenticate: Bearer realm="…",service="…",scope="…"`.
#[derive(Debug, PartialEq, Eq)]
struct Challenge {
    realm: String,
    service: Option<String>,
    scope: Option<String>,
}

impl Challenge {
    fn parse(header: &str) -> Option<Self> {
        let (scheme, mut rest) = header.trim().split_once(char::is_whitespace)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let (mut realm, mut service, mut scope) = (None, None, None);
        loop {
            rest = rest.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
            if rest.is_empty() {
                break;
            }
            let (key, after) = rest.split_once('=')?;
            let after = after.trim_start();
            let (value, remaining) = if let Some(quoted) = after.strip_prefix('"') {
                let mut value = String::new();
                let mut end = None;
                let mut chars = quoted.char_indices();
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => value.extend(chars.next().map(|(_, c)| c)),
                        '"' => {
                            end = Some(i + 1);
                            break;
                        }
                        c => value.push(c),
                    }
                }
                (value, &quoted[end?..])
            } else {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim().to_owned(), &after[end..])
            };
            match key.trim().to_ascii_lowercase().as_str() {
                "realm" => realm = Some(value),
                "service" => service = Some(value),
                "scope" => scope = Some(value),
                _ => {}
            }
            rest = remaining;
        }
        Some(Self { realm: realm?, service, scope })
    }
}

/// Parses a `WWW-Authenticate` header as the client does before it asks for a token:
/// `(realm, service, scope)` of a Bearer challenge, `None` for anything else.  The entry
/// point of the `registry_headers` fuzz target.
#[must_use]
pub fn parse_bearer_challenge(header: &str) -> Option<(String, Option<String>, Option<String>)> {
    Challenge::parse(header).map(|c| (c.realm, c.service, c.scope))
}

#[cfg(test)]
mod tests {
    use super::Challenge;

    #[test]
    fn bearer_challenges_parse() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:library/m:pull""#,
        )
        .expect("challenge");
        assert_eq!(c.realm, "https://auth.example/token");
        assert_eq!(c.service.as_deref(), Some("registry.example"));
        assert_eq!(c.scope.as_deref(), Some("repository:library/m:pull"));
        let c = Challenge::parse(r#"bearer  scope="a:b:pull,push", realm=http://h/t , x="q\"uote""#).expect("loose");
        assert_eq!(c.realm, "http://h/t");
        assert_eq!(c.scope.as_deref(), Some("a:b:pull,push"));
        assert_eq!(c.service, None);
        for bad in ["Basic realm=\"x\"", "Bearer service=\"s\"", "Bearer", "Bearer realm=\"unterminated"] {
            assert_eq!(Challenge::parse(bad), None, "{bad}");
        }
    }
}
