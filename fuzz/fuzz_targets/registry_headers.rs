//! Feeds arbitrary text to the registry client's header parsers: `WWW-Authenticate`
//! (a Bearer challenge: realm, service, scope) and `Content-Range` of a ranged download.
//! A challenge that parses, written again with every value quoted, parses to the same
//! values; a `Content-Range` that parses is a range that exists (`first <= last <
//! total`) and its canonical form parses back to it.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::store::registry::{parse_bearer_challenge, parse_content_range};
use libfuzzer_sys::fuzz_target;

fn quoted(value: &str) -> String {
    format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
}

fuzz_target!(|data: &[u8]| {
    let text = common::text(data);
    if let Some((realm, service, scope)) = parse_bearer_challenge(&text) {
        let mut again = format!("Bearer realm={}", quoted(&realm));
        if let Some(service) = &service {
            again.push_str(&format!(",service={}", quoted(service)));
        }
        if let Some(scope) = &scope {
            again.push_str(&format!(", scope={}", quoted(scope)));
        }
        assert_eq!(parse_bearer_challenge(&again), Some((realm, service, scope)), "{text:?} -> {again:?}");
    }
    if let Some((first, last, total)) = parse_content_range(&text) {
        assert!(first <= last, "{text:?}");
        assert!(total.is_none_or(|total| last < total), "{text:?}");
        let again = format!("bytes {first}-{last}/{}", total.map_or("*".to_owned(), |t| t.to_string()));
        assert_eq!(parse_content_range(&again), Some((first, last, total)), "{text:?} -> {again:?}");
    }
});
