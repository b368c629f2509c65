//! Reading a runner's answer as it streams past, however the network cut it: the events
//! of a server-sent event stream ([`EventScanner`]), or the end of a JSON answer
//! ([`JsonTail`]). Both `/api/chat` and `/api/generate` (which turn the events into
//! Ollama's NDJSON) and `/v1/*` (which counts the tokens passing through) read the
//! runner's stream here; what they make of each event is theirs.
//!
//! What either gives does not depend on where the cuts fall (the tests below and the
//! `sse_stream` fuzz target check it).

use serde_json::Value;

/// The `data:` payloads of a server-sent event stream, as JSON, from pieces cut anywhere.
///
/// llama-server sends one JSON object per `data:` line. A line is read once its `\n`
/// arrived; the rest waits for the next piece. Lines that are not `data:` (comments,
/// `event:`, the blank line between events), the end marker `[DONE]`, and payloads that
/// are not JSON are skipped: a runner's stream is read for what it says, never refused.
#[derive(Debug, Default)]
pub(super) struct EventScanner {
    /// The unfinished line.
    pending: Vec<u8>,
}

impl EventScanner {
    /// The events whose lines `bytes` completed, in order.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> Vec<Value> {
        // Only the new bytes are searched: what waits holds no line end, and a line can be
        // as long as the request it echoes (llama-server's last event repeats a request's
        // `stop` list and grammar), so searching all of it per piece grew with its square.
        let Some(end) = bytes.iter().rposition(|b| *b == b'\n') else {
            self.pending.extend_from_slice(bytes);
            return Vec::new();
        };
        let last = self.pending.len() + end;
        self.pending.extend_from_slice(bytes);
        let complete: Vec<u8> = self.pending.drain(..=last).collect();
        complete.split(|b| *b == b'\n').filter_map(data).collect()
    }

    /// The line still waiting for its end.
    pub(super) fn pending(&self) -> &[u8] {
        &self.pending
    }
}

/// A line's payload, when it is a `data:` line holding JSON.
fn data(line: &[u8]) -> Option<Value> {
    // Text as llama-server means it: bad bytes replaced, not a reason to drop the line.
    let line = String::from_utf8_lossy(line);
    let data = line.trim_end().strip_prefix("data:")?.trim();
    if data.is_empty() || data == "[DONE]" {
        return None;
    }
    serde_json::from_str(data).ok()
}

/// The last bytes of a JSON answer, to find a field that comes at its end (`usage`,
/// after the choices or embeddings) without holding a large answer.
#[derive(Debug)]
pub(super) struct JsonTail {
    tail: Vec<u8>,
    keep: usize,
}

impl JsonTail {
    /// A tail of at most `keep` bytes.
    pub(super) fn new(keep: usize) -> Self {
        Self { tail: Vec::new(), keep }
    }

    /// Adds the next piece of the answer.
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
        let excess = self.tail.len().saturating_sub(self.keep);
        self.tail.drain(..excess);
    }

    /// The bytes kept.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.tail
    }

    /// The value of the last `"name":` in the tail. A string inside the answer that
    /// holds the same text has its quotes escaped, so it cannot match.
    pub(super) fn last_field(&self, name: &str) -> Option<Value> {
        let tail = String::from_utf8_lossy(&self.tail);
        let key = format!("\"{name}\":");
        let at = tail.rfind(&key)?;
        serde_json::Deserializer::from_str(&tail[at + key.len()..]).into_iter::<Value>().next()?.ok()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{EventScanner, JsonTail};

    /// Everything the scanner gives for `bytes` cut at `cuts` (offsets, any order), and
    /// what it still holds.
    fn scan(bytes: &[u8], cuts: &[usize]) -> (Vec<Value>, Vec<u8>) {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let mut scanner = EventScanner::default();
        let mut events = Vec::new();
        let mut from = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            events.extend(scanner.feed(&bytes[from..cut]));
            from = cut;
        }
        (events, scanner.pending().to_vec())
    }

    #[test]
    fn data_lines_are_events_and_everything_else_is_skipped() {
        let stream = concat!(
            ": a comment\n",
            "event: message\n",
            "data: {\"a\":1}\n",
            "\n",
            "data:{\"b\":2}  \r\n\r\n",
            "data: not json\n\n",
            "data:\n\n",
            "data: [DONE]\n\n",
            " data: {\"indented\":true}\n",
            "data: {\"c\":3}"
        );
        let (events, pending) = scan(stream.as_bytes(), &[]);
        assert_eq!(events, [json!({"a": 1}), json!({"b": 2})]);
        assert_eq!(pending, b"data: {\"c\":3}", "the last line waits for its end");
    }

    #[test]
    fn a_line_split_anywhere_is_read_once_whole() {
        let stream = b"data: {\"text\":\"h\xc3\xa9\"}\n\ndata: {\"n\":2}\n\n";
        for cut in 0..=stream.len() {
            assert_eq!(scan(stream, &[cut]).0, [json!({"text": "hé"}), json!({"n": 2})], "cut at {cut}");
        }
    }

    /// A line of 16 MiB (llama-server's last event echoes a request's `stop` list and
    /// grammar, which can be as large as a request) in 8 KiB pieces is read once, whole:
    /// searching the whole waiting line for its end at each piece took minutes.
    #[test]
    fn a_long_line_in_small_pieces_is_read_whole() {
        let stop: Vec<String> = (0..1_700_000).map(|i| format!("s{i}")).collect();
        let line = format!("data: {}\n\n", json!({ "stop": stop }));
        assert!(line.len() > 16 << 20, "{} bytes", line.len());
        let mut scanner = EventScanner::default();
        let mut events = Vec::new();
        for piece in line.as_bytes().chunks(8 << 10) {
            events.extend(scanner.feed(piece));
        }
        assert_eq!(events.len(), 1);
        assert_eq!(events[0]["stop"].as_array().map(Vec::len), Some(stop.len()));
        assert!(scanner.pending().is_empty());
    }

    #[test]
    fn bad_bytes_in_a_line_are_replaced_not_dropped() {
        let (events, _) = scan(b"data: {\"t\":\"a\xffb\"}\n", &[]);
        assert_eq!(events, [json!({"t": "a\u{fffd}b"})]);
    }

    #[test]
    fn a_json_tail_keeps_its_last_bytes_and_finds_the_last_field() {
        let mut tail = JsonTail::new(64);
        let padding = "x".repeat(500);
        let answer = format!(
            "{{\"choices\":[{{\"text\":\"{padding} \\\"usage\\\":\"}}],\"usage\":{{\"prompt_tokens\":3}},\"id\":\"x\"}}"
        );
        for piece in answer.as_bytes().chunks(7) {
            tail.feed(piece);
        }
        assert_eq!(tail.bytes().len(), 64);
        assert_eq!(tail.last_field("usage"), Some(json!({"prompt_tokens": 3})));
        assert_eq!(tail.last_field("model"), None);
        let mut cut_off = JsonTail::new(8);
        cut_off.feed(answer.as_bytes());
        assert_eq!(cut_off.last_field("usage"), None, "a field beyond the tail is not guessed at");
    }

    /// A stream of event lines, the kind a runner sends, with noise between them.
    fn stream() -> impl Strategy<Value = Vec<u8>> {
        let line = prop_oneof![
            any::<u32>().prop_map(|n| format!("data: {{\"n\":{n}}}\n\n")),
            "[a-zé]{0,8}".prop_map(|t| format!("data:{{\"t\":\"{t}\"}}\r\n")),
            Just("data: [DONE]\n\n".to_owned()),
            Just(": keep-alive\n".to_owned()),
            Just("\n".to_owned()),
            Just("data: {broken\n".to_owned()),
        ];
        (proptest::collection::vec(line, 0..12), proptest::collection::vec(any::<u8>(), 0..6))
            .prop_map(|(lines, tail)| [lines.concat().into_bytes(), tail].concat())
    }

    proptest! {
        #[test]
        fn events_do_not_depend_on_the_cuts(
            bytes in stream(),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            prop_assert_eq!(scan(&bytes, &cuts), scan(&bytes, &[]));
        }

        #[test]
        fn any_bytes_scan_the_same_however_cut(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            prop_assert_eq!(scan(&bytes, &cuts), scan(&bytes, &[]));
        }

        #[test]
        fn a_tail_is_the_answers_end_however_cut(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            keep in 0usize..64,
            size in 1usize..32,
        ) {
            let mut tail = JsonTail::new(keep);
            for piece in bytes.chunks(size) {
                tail.feed(piece);
            }
            prop_assert_eq!(tail.bytes(), &bytes[bytes.len().saturating_sub(keep)..]);
        }
    }
}
