//! Feeds arbitrary bytes to what corrald reads its saved listing (`listing.json` in its
//! state directory) with at start. Every entry taken passes the store's own checks (a
//! name that parses back to itself, a weights layer, the size of its blobs), and the
//! entries, written as corrald writes them, read back the same.

#![no_main]

use std::path::Path;

use corral::store::manifest::MODEL;
use corral::store::name::ModelName;
use corral::store::saved_listing::{parse, to_bytes};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let root = Path::new("/var/lib/corral/models");
    let Ok(entries) = parse(data, root) else { return };
    for (_, listed) in &entries {
        let name = listed.name.to_string();
        assert_eq!(ModelName::parse(&name).expect("a taken name parses").to_string(), name);
        assert_eq!(listed.manifest.model().media_type, MODEL);
        assert_eq!(listed.size, listed.manifest.size());
    }
    let back = parse(&to_bytes(root, &entries), root).expect("a written listing parses");
    let key = |e: &&corral::store::saved_listing::Entry| e.1.name.to_string();
    let (mut entries, mut back) = (entries.iter().collect::<Vec<_>>(), back.iter().collect::<Vec<_>>());
    entries.sort_by_key(key);
    back.sort_by_key(key);
    assert_eq!(entries, back, "written and read back, the same entries");
    if !entries.is_empty() {
        assert!(parse(data, Path::new("/elsewhere")).expect("parsed once").is_empty(), "another store's listing");
    }
});
