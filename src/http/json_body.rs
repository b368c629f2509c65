//! A request's JSON body as an object: the one parser of every JSON endpoint.
//!
//! Besides its bytes (`[server] max_body`) and depth (`serde_json`'s 128), a body's count of
//! values is bounded: parsed into `serde_json::Value`s, `[0,0,0,…]` takes 16 times its
//! bytes (32 per value for 2 bytes of text), so the largest body allowed would take a GiB.
//! The bound is far above what a request carries (a prompt of a million token ids, the
//! texts of a batch of embeddings); a body past it is refused before it is parsed.

use axum::http::StatusCode;
use serde_json::{Map, Value};

use super::error::{ApiError, bad};

/// The most JSON values a request body may hold.
pub(super) const VALUES_MAX: usize = 1 << 20;

/// Bodies shorter than this cannot hold [`VALUES_MAX`] values (each takes at least two
/// bytes, a digit and a comma), so they are not counted.
const COUNTED_FROM: usize = 2 * VALUES_MAX;

/// The request body as a JSON object (no content type required, as with Ollama).
pub(super) fn json_object(path: &str, body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(bad("missing request body", path));
    }
    if body.len() >= COUNTED_FROM && !values_within(body, VALUES_MAX) {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body holds more than {VALUES_MAX} JSON values"),
            path,
        ));
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(bad("the request body must be a JSON object", path)),
        Err(e) => Err(bad(format!("invalid JSON in the request body: {e}"), path)),
    }
}

/// Whether `json` holds at most `max` values, counted from outside strings: each value
/// but the first follows a `[`, a `,` or a `:` (an empty array's `[` counts one too many,
/// which only errs toward refusing). Text that is not JSON is counted the same and then
/// refused by the parser.
fn values_within(json: &[u8], max: usize) -> bool {
    let (mut values, mut in_string, mut escaped) = (1usize, false, false);
    for &byte in json {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match byte {
                b'"' => in_string = true,
                b'[' | b',' | b':' => {
                    values += 1;
                    if values > max {
                        return false;
                    }
                }
                _ => {}
            }
        }
    }
    values <= max
}

#[cfg(test)]
mod tests {
    use super::{COUNTED_FROM, VALUES_MAX, json_object, values_within};

    #[test]
    fn values_are_counted_outside_strings_only() {
        for (json, values) in [
            ("{}", 1),
            (r#"{"a":1}"#, 2),
            (r#"{"a":[1,2,3],"b":{"c":null}}"#, 8),
            (r#"{"text":"a,b:c[d\",e\\"}"#, 2),
            (r#"["\\",1]"#, 3),
        ] {
            assert!(values_within(json.as_bytes(), values), "{json}: at most {values}");
            assert!(!values_within(json.as_bytes(), values - 1), "{json}: more than {}", values - 1);
        }
    }

    /// A body of small values past the bound is refused before it is parsed (413, naming
    /// the bound); one at it, or a long string of as many bytes, is read.
    #[test]
    fn a_body_of_too_many_values_is_refused_and_long_texts_are_not() {
        let numbers = |n: usize| format!(r#"{{"prompt":[{}0]}}"#, "0,".repeat(n - 3));
        let at = numbers(VALUES_MAX);
        assert!(at.len() >= COUNTED_FROM, "the test's body is counted");
        assert!(json_object("/v1/completions", at.as_bytes()).is_ok());
        let error = json_object("/v1/completions", numbers(VALUES_MAX + 1).as_bytes()).expect_err("too many");
        assert_eq!(error.status(), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(error.message(), "the request body holds more than 1048576 JSON values");
        let text = format!(r#"{{"prompt":"{}"}}"#, "a,".repeat(VALUES_MAX * 4));
        assert!(json_object("/api/generate", text.as_bytes()).is_ok(), "commas in a string are text");
    }
}
