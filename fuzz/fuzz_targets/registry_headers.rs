//! Feeds arbitrary text to the registry client's header parsers: `WWW-Authenticate`
//! (a Bearer challenge: realm, service, scope), `Content-Range` of a ranged download, and
//! the whole head of an answer read by hand (`parse_answer_head`): it never panics, a head
//! it finds ends within the bytes and parses the same from exactly those bytes, and every
//! shorter prefix is incomplete or refused.
//! A challenge that parses, written again with every value quoted, parses to the same
//! values; a `Content-Range` that parses is a range that exists (`first <= last <
//! total`) and its canonical form parses back to it.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::store::registry::{parse_answer_head, parse_bearer_challenge, parse_content_range};
use libfuzzer_sys::fuzz_target;

fn quoted(value: &str) -> String {
    format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(head)) = parse_answer_head(data) {
        assert!(head.length <= data.len(), "{head:?}");
        assert_eq!(parse_answer_head(&data[..head.length]), Ok(Some(head.clone())));
        if head.length > 0 {
            assert!(!matches!(parse_answer_head(&data[..head.length - 1]), Ok(Some(_))), "{head:?}");
        }
    }
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
