//! Feeds arbitrary bytes as a runner's answer stream to the one scanner that reads it
//! (`http::stream_scan`: server-sent events, or a JSON answer's tail) and to the two
//! readers built on it: `/api/chat` and `/api/generate`'s (events turned into Ollama's
//! NDJSON lines, tool calls put together) and `/v1/*`'s token counter (events, or a JSON
//! answer's tail).  What they make of a stream does not depend on how it was cut into
//! pieces, and the tail holds the stream's last bytes, no more.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::http::parsers::{generation_events, openai_usage, stream_scan};
use libfuzzer_sys::fuzz_target;

/// A tail small enough for the fuzzer's inputs to overflow it.
const KEEP: usize = 64;

fuzz_target!(|data: &[u8]| {
    let pieces = common::pieces(data);
    let whole = data.get(1..).unwrap_or_default();
    let scanned = stream_scan(&pieces, KEEP);
    assert_eq!(scanned, stream_scan(&[whole], KEEP), "the scan depends on the cuts");
    let (_, pending, tail, _) = &scanned;
    assert!(whole.ends_with(pending) && !pending.contains(&b'\n'), "the pending line is the stream's unfinished end");
    assert_eq!(tail.as_slice(), &whole[whole.len().saturating_sub(KEEP)..], "the tail is the stream's end");
    assert_eq!(generation_events(&pieces), generation_events(&[whole]), "the events depend on the cuts");
    for events in [true, false] {
        assert_eq!(openai_usage(events, &pieces), openai_usage(events, &[whole]), "the counts depend on the cuts");
    }
});
