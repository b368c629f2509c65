//! Feeds arbitrary bytes as a llama-server's stderr, cut into pieces, through the line
//! splitter and the load report, as the supervisor reads a child.  Lines do not depend on
//! how the stream was cut and stay within the cap; the report keeps at most
//! `MAX_ERROR_LINES` errors and its sums do not overflow.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::supervisor::logparse::{LineSplitter, LoadReport, MAX_ERROR_LINES, parse_line};
use libfuzzer_sys::fuzz_target;

/// A small cap, so that long lines are common.
const MAX_LINE: usize = 200;

fuzz_target!(|data: &[u8]| {
    let mut splitter = LineSplitter::with_max_line(MAX_LINE);
    let mut lines: Vec<String> = common::pieces(data).into_iter().flat_map(|p| splitter.push(p)).collect();
    lines.extend(splitter.finish());
    let mut whole = LineSplitter::with_max_line(MAX_LINE);
    let mut expected = whole.push(data.get(1..).unwrap_or_default());
    expected.extend(whole.finish());
    assert_eq!(lines, expected, "the lines depend on how the stream was cut");

    let mut report = LoadReport::new();
    for line in &lines {
        // The cap plus " [… N bytes cut]", and U+FFFD (3 bytes) for each bad byte kept.
        assert!(line.len() <= MAX_LINE * 3 + 40, "a line of {} bytes", line.len());
        let parsed = report.feed(line);
        assert!(parsed.message.len() <= line.len());
        assert!((0..=7).contains(&parsed.priority()));
        assert_eq!(parse_line(line), parsed, "parsing is a function of the line");
    }
    assert!(report.errors().count() <= MAX_ERROR_LINES);
    let _ = (report.vram_bytes(), report.ram_bytes(), report.offload(), report.listening());
    let _ = (report.failure_class(), report.failure_message(), report.model_loaded(), report.task_loop_running());
    for (key, bytes) in report.buffers() {
        // A buffer's total over the components that printed it includes this one.
        assert!(report.buffer_bytes(&key.buffer, key.kind) >= bytes);
    }
});
