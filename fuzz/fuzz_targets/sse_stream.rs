//! Feeds arbitrary bytes as a runner's answer stream to the two scanners that read it:
//! `/api/chat` and `/api/generate`'s (server-sent events turned into Ollama's NDJSON
//! lines, tool calls put together) and `/v1/*`'s token counter (events, or a JSON answer's
//! tail).  What they make of a stream does not depend on how it was cut into pieces.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::http::parsers::{generation_events, openai_usage};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let pieces = common::pieces(data);
    let whole = data.get(1..).unwrap_or_default();
    assert_eq!(generation_events(&pieces), generation_events(&[whole]), "the events depend on the cuts");
    for events in [true, false] {
        assert_eq!(openai_usage(events, &pieces), openai_usage(events, &[whole]), "the counts depend on the cuts");
    }
});
