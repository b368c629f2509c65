//! Feeds arbitrary bytes, line by line, as llama-server's `--fit` dry run's stderr to
//! `projection::DryRunReader`, as corrald reads it for an exact plan.  Whatever it reads
//! never panics; a projection it gives keeps the invariants (fewer than `MAX_ROWS`
//! devices, distinct names, model and context in whole MiB within `MAX_MIB`, compute
//! within a MiB above the table's figure) and builds again from its rows.

#![no_main]

use corral::projection::{DryRunReader, MAX_MIB, MAX_ROWS, Projection, RESOLUTION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut reader = DryRunReader::default();
    let mut complete = false;
    for line in text.lines() {
        match reader.feed(line) {
            Ok(true) => {
                complete = true;
                break;
            }
            Ok(false) => {}
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        }
    }
    let buffers = [("RPC0".to_owned(), "RPC0[a:1]".to_owned()), ("CUDA0".to_owned(), "CUDA0".to_owned())];
    match reader.projection(&buffers) {
        Ok(p) => {
            assert!(complete, "a projection only from a complete table");
            assert!(p.devices().len() < MAX_ROWS);
            for (i, d) in p.devices().iter().enumerate() {
                assert!(p.devices()[..i].iter().all(|other| other.name != d.name), "{p:?}");
                for bytes in [d.usage.model, d.usage.context] {
                    assert!(bytes <= MAX_MIB * RESOLUTION && bytes % RESOLUTION == 0, "{p:?}");
                }
                assert!(d.usage.compute <= MAX_MIB * RESOLUTION + RESOLUTION, "{p:?}");
            }
            assert_eq!(Projection::new(p.devices().to_vec(), p.host()).as_ref(), Ok(&p));
        }
        Err(e) => assert!(!complete || !e.to_string().is_empty()),
    }
});
