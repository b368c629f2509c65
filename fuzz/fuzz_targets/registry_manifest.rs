//! Feeds arbitrary bytes to what a registry's manifest and config blob are parsed with.
//! A manifest that is accepted is schema 2 with a model layer, and serializes to bytes
//! that parse back to it.

#![no_main]

use corral::store::manifest::{MANIFEST_MEDIA_TYPE, MODEL, Manifest, ModelConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Manifest::parse(data) {
        Ok(m) => {
            assert_eq!(m.schema_version(), 2);
            assert_eq!(m.media_type(), MANIFEST_MEDIA_TYPE);
            assert_eq!(m.model().media_type, MODEL);
            assert_eq!(m.blobs().count(), m.layers().len() + 1);
            let _ = m.size();
            let back = Manifest::parse(&m.to_bytes()).expect("a written manifest parses");
            assert_eq!(back, m);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    if let Ok(config) = serde_json::from_slice::<ModelConfig>(data) {
        let bytes = serde_json::to_vec(&config).expect("a config serializes");
        assert_eq!(serde_json::from_slice::<ModelConfig>(&bytes).expect("parses back"), config);
    }
});
