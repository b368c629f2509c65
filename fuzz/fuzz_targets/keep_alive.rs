//! Feeds arbitrary text to `keep_alive`'s reader, as a Go duration string and as any JSON
//! value.  A duration is accepted or refused with its reason, never a panic; what is
//! accepted is never longer than any clock arithmetic takes, and the server's clamps bound it.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::time::Duration;

use corral::scheduler::keep_alive::{Clamp, KeepAlive, resolve};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn check(value: &Value) {
    match KeepAlive::from_json(Some(value)) {
        Ok(Some(keep_alive)) => {
            if let KeepAlive::For(d) = keep_alive {
                assert!(d <= corral::durations::LONGEST, "{value}: {d:?}");
            }
            let clamp = Clamp { min: Some(Duration::from_secs(1)), max: Some(Duration::from_secs(3600)) };
            let resolved = resolve(Some(keep_alive), None, KeepAlive::Forever, clamp);
            assert!(keep_alive.is_zero() || resolved <= KeepAlive::For(Duration::from_secs(3600)));
        }
        Ok(None) => assert!(value.is_null()),
        Err(e) => assert!(e.to_string().starts_with("invalid keep_alive")),
    }
}

fuzz_target!(|data: &[u8]| {
    check(&Value::String(common::text(data).into_owned()));
    if let Ok(value) = serde_json::from_slice::<Value>(data) {
        check(&value);
    }
});
