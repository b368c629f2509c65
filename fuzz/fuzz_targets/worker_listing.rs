//! Feeds arbitrary text as a worker's answer to `llama-server --rpc ADDR --list-devices`
//! to `gpu::rpc::parse_list`. An accepted listing holds between one and `MAX_DEVICES` RPC
//! devices with distinct names, none with more free than total memory.

#![no_main]

use corral::gpu::rpc::{MAX_DEVICES, parse_list};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match parse_list(text) {
        Ok(devices) => {
            assert!(!devices.is_empty() && devices.len() <= MAX_DEVICES, "{devices:?}");
            for (i, d) in devices.iter().enumerate() {
                assert!(d.name.starts_with("RPC"), "{d:?}");
                assert!(d.free_bytes <= d.total_bytes, "{d:?}");
                assert!(devices[..i].iter().all(|other| other.name != d.name), "{devices:?}");
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
