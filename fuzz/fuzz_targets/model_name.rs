//! Feeds arbitrary text to the model-name parser (every request and D-Bus call that names
//! a model).  A name that parses is four plain path components below `manifests/` (no
//! separator, no `.`/`..`, no NUL), and its short and full forms parse back to it.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::path::Component;

use corral::store::name::ModelName;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = common::text(data);
    match ModelName::parse(&text) {
        Ok(name) => {
            let path = name.manifest_path();
            let parts: Vec<Component<'_>> = path.components().collect();
            assert_eq!(parts.len(), 4, "{text:?} -> {path:?}");
            for part in parts {
                let Component::Normal(part) = part else { panic!("{text:?} -> {path:?}: {part:?}") };
                let part = part.to_str().expect("UTF-8");
                assert!(!part.is_empty() && part != "." && part != "..", "{text:?} -> {part:?}");
                assert!(!part.contains(['/', '\\', '\0']), "{text:?} -> {part:?}");
                assert!(part.is_ascii(), "{text:?} -> {part:?}");
            }
            assert_eq!(ModelName::parse(&name.to_string()).as_ref(), Ok(&name), "short form of {text:?}");
            assert_eq!(ModelName::parse(&name.full()).as_ref(), Ok(&name), "full form of {text:?}");
            assert_eq!(name.repository(), format!("{}/{}", name.namespace(), name.model()));
        }
        Err(e) => {
            assert!(e.to_string().starts_with("invalid model name"));
            assert!(e.name.chars().count() <= 200, "the echoed name is cut");
        }
    }
});
