//! Feeds arbitrary text to the digest parser (blob paths, manifests, `/api/blobs/:digest`,
//! `files` of `/api/create`), as a string and as JSON.  A digest that parses is
//! `sha256` and 64 hex digits, and prints back to what was read (the case aside); its file
//! name is a plain path component.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::store::digest::Digest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = common::text(data);
    match Digest::parse(&text) {
        Ok(d) => {
            assert!(text.len() == 71 && (text.starts_with("sha256:") || text.starts_with("sha256-")), "{text:?}");
            assert!(text[7..].eq_ignore_ascii_case(&d.hex()), "{text:?}");
            assert_eq!(Digest::parse(&d.to_string()), Ok(d));
            assert_eq!(Digest::parse(&d.file_name()), Ok(d));
            let name = d.file_name();
            assert!(name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'), "{name}");
        }
        Err(e) => assert!(e.to_string().contains("expected sha256:<64 hex digits>")),
    }
    // In JSON (manifests, the partial-download record) only the colon form is valid.
    if let Ok(d) = serde_json::from_slice::<Digest>(data) {
        let s: String = serde_json::from_slice(data).expect("a JSON string");
        assert!(s.starts_with("sha256:"), "{s:?}");
        assert_eq!(
            serde_json::to_string(&d).expect("json").to_ascii_lowercase(),
            format!("\"{}\"", s.to_ascii_lowercase())
        );
    }
});
