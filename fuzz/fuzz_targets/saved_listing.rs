//! Feeds arbitrary bytes to what corrald reads its saved listing (`listing.json` in its
//! state directory) with at start. Every entry taken passes the store's own checks (a
//! name that parses back to itself, a weights layer, the size of its blobs), blob facts
//! name a listed manifest and known capabilities only, and what was taken, written as
//! corrald writes it, reads back the same.

#![no_main]

use std::path::Path;

use corral::store::manifest::MODEL;
use corral::store::name::ModelName;
use corral::store::saved_listing::{Saved, parse, to_bytes};
use corral::store::show::CAPABILITIES;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let root = Path::new("/var/lib/corral/models");
    let Ok(saved) = parse(data, root) else { return };
    for (_, listed) in &saved.entries {
        let name = listed.name.to_string();
        assert_eq!(ModelName::parse(&name).expect("a taken name parses").to_string(), name);
        assert_eq!(listed.manifest.model().media_type, MODEL);
        assert_eq!(listed.size, listed.manifest.size());
    }
    for (digest, facts) in &saved.facts {
        assert!(saved.entries.iter().any(|(_, listed)| listed.digest == *digest), "facts of a digest no model has");
        assert!(facts.capabilities.iter().all(|c| CAPABILITIES.contains(c)), "{:?}", facts.capabilities);
    }
    let back = parse(&to_bytes(root, &saved), root).expect("a written listing parses");
    let key = |e: &&corral::store::saved_listing::Entry| e.1.name.to_string();
    let (mut entries, mut back_entries) = (saved.entries.iter().collect::<Vec<_>>(), back.entries.iter().collect::<Vec<_>>());
    entries.sort_by_key(key);
    back_entries.sort_by_key(key);
    assert_eq!(entries, back_entries, "written and read back, the same entries");
    assert_eq!(saved.facts, back.facts, "written and read back, the same facts");
    if !entries.is_empty() {
        assert_eq!(parse(data, Path::new("/elsewhere")).expect("parsed once"), Saved::default(), "another store's listing");
    }
});
