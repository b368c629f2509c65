//! Feeds arbitrary bytes as `llama-fit-params --fit-print on`'s stdout to
//! `projection::Projection::parse`.  An accepted projection keeps its invariants (fewer
//! than `MAX_ROWS` devices, distinct names, figures within `MAX_MIB` MiB), builds again
//! from its rows, and reads back from its JSON (the cache's file) unchanged.

#![no_main]

use corral::projection::{MAX_MIB, MAX_OUTPUT, MAX_ROWS, ParseError, Projection, RESOLUTION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Projection::parse(data) {
        Ok(p) => {
            assert!(data.len() <= MAX_OUTPUT);
            assert!(p.devices().len() < MAX_ROWS);
            for (i, d) in p.devices().iter().enumerate() {
                assert!(p.devices()[..i].iter().all(|other| other.name != d.name), "{p:?}");
                assert_eq!(p.device(&d.name), Some(d.usage));
                for bytes in [d.usage.model, d.usage.context, d.usage.compute] {
                    assert!(bytes <= MAX_MIB * RESOLUTION && bytes % RESOLUTION == 0, "{p:?}");
                }
            }
            assert_eq!(Projection::new(p.devices().to_vec(), p.host()).as_ref(), Ok(&p));
            let json = serde_json::to_vec(&p).expect("a projection serializes");
            assert_eq!(serde_json::from_slice::<Projection>(&json).expect("and reads back"), p);
        }
        Err(ParseError::TooLong) => assert!(data.len() > MAX_OUTPUT),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    // The cache's file holds projections as JSON: whatever it holds is checked the same way.
    if let Ok(p) = serde_json::from_slice::<Projection>(data) {
        assert_eq!(Projection::new(p.devices().to_vec(), p.host()).as_ref(), Ok(&p));
    }
});
