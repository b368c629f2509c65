//! Messages for clients without the server's file-system layout.
//!
//! Core errors name the files they failed on (the store's blobs and manifests, the
//! configuration, llama-server, runner sockets): the journal needs that. Clients of the
//! HTTP API and of D-Bus do not, and a path tells a hostile one where things are. The
//! edges (`http::ApiError`, the D-Bus error mapping and job results) pass every message
//! through [`server_paths`], and log the original where it changed.

use std::borrow::Cow;

/// What may come right before a path: a path starts a word or follows a quote, a bracket
/// or `=`.
fn starts_word(previous: Option<char>) -> bool {
    previous.is_none_or(|c| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '(' | '[' | '{' | '<' | '=' | ','))
}

/// What ends a path: white space, quotes, closing brackets and the punctuation that
/// follows a path in a message (`cannot open /x/y: denied`, `(/x/y)`, `"/x/y",`).
fn ends_path(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | ')' | ']' | '}' | '>' | ',' | ';' | ':')
}

/// `message` with every absolute path replaced by `…/` and its last component:
/// `cannot open /var/lib/corral/models/blobs/sha256-ab: denied` becomes
/// `cannot open …/sha256-ab: denied`. URLs (`https://host/path`) and fractions
/// (`tokens/s`) are not paths: a path starts a word.
#[must_use]
pub fn server_paths(message: &str) -> Cow<'_, str> {
    let mut out = String::new();
    let mut copied = 0;
    let mut previous = None;
    let mut chars = message.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        let next = chars.peek().map(|&(_, n)| n);
        if c == '/' && starts_word(previous) && next.is_some_and(|n| !ends_path(n) && n != '/') {
            let mut end = message.len();
            while let Some(&(i, n)) = chars.peek() {
                if ends_path(n) {
                    end = i;
                    break;
                }
                chars.next();
            }
            let path = &message[start..end];
            let last = path.trim_end_matches('/').rsplit('/').next().unwrap_or_default();
            out.push_str(&message[copied..start]);
            out.push_str("…/");
            out.push_str(last);
            copied = end;
            previous = path.chars().last();
            continue;
        }
        previous = Some(c);
    }
    if copied == 0 {
        return Cow::Borrowed(message);
    }
    out.push_str(&message[copied..]);
    Cow::Owned(out)
}

/// [`server_paths`] for a message about to leave through `edge`, logging the original
/// when anything was removed, so that the journal keeps the whole error.
#[must_use]
pub fn for_client(message: String, edge: &str) -> String {
    match server_paths(&message) {
        Cow::Borrowed(_) => message,
        Cow::Owned(public) => {
            tracing::info!(edge, error = %message, "an error's server paths were kept from the client");
            public
        }
    }
}

#[cfg(test)]
mod tests {
    use super::server_paths;

    #[test]
    fn absolute_paths_keep_only_their_last_component() {
        let cases = [
            (
                "cannot write /var/lib/corral/models/blobs/.tmp-x1: No space left on device (os error 28)",
                "cannot write …/.tmp-x1: No space left on device (os error 28)",
            ),
            ("cannot read \"/etc/corral/corral.toml\": denied", "cannot read \"…/corral.toml\": denied"),
            ("/etc/corral/conf.d/a.toml:3: unknown field", "…/a.toml:3: unknown field"),
            ("failed to start (/usr/bin/llama-server) here", "failed to start (…/llama-server) here"),
            ("in /srv/models/, twice: /srv/models/", "in …/models, twice: …/models"),
            ("path=/run/corral/runner-1.sock", "path=…/runner-1.sock"),
            ("two /a/b and /c", "two …/b and …/c"),
        ];
        for (message, public) in cases {
            assert_eq!(server_paths(message), public, "{message}");
        }
    }

    #[test]
    fn urls_fractions_and_plain_text_are_untouched() {
        for message in [
            "pulling https://registry.ollama.ai/v2/library/x/manifests/latest failed",
            "generated 12 tokens/s, 1/2 done",
            "model \"library/x:latest\" not found",
            "a lone / slash and // two",
            "",
        ] {
            assert!(matches!(server_paths(message), std::borrow::Cow::Borrowed(_)), "{message}");
        }
    }

    #[test]
    fn non_ascii_text_around_paths_survives() {
        assert_eq!(server_paths("é /home/zoë/modèle.gguf — non"), "é …/modèle.gguf — non");
    }
}
