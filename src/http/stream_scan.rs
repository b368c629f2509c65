//! Reading a runner's answer as it streams past, however the network cut it: the events
//! of a server-sent event stream ([`EventScanner`]), the end of a JSON answer
//! ([`JsonTail`]), or the first ids of a `/tokenize` answer ([`TokenPrefix`]). Both
//! `/api/chat` and `/api/generate` (which turn the events into Ollama's NDJSON) and
//! `/v1/*` (which counts the tokens passing through) read the runner's stream here, and
//! `/api/embed` its token counts; what they make of each is theirs.
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

/// The first ids of a runner's `/tokenize` answer (`{"tokens":[1,2,…]}`), read as it
/// streams past: at most `limit + 1` are kept, so a long input's tokens are counted only
/// as far as a request can hold them, never all held. Written by hand because a JSON
/// parser reads a list whole; this reads only the one list of integers it expects.
#[derive(Debug)]
pub(super) struct TokenPrefix {
    limit: usize,
    tokens: Vec<u32>,
    /// The number being read, if a digit came since the last separator.
    current: Option<u32>,
    /// Whether space followed that number (only a separator may come next).
    spaced: bool,
    state: TokenState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenState {
    /// Before the list's `[`.
    Before,
    InList,
    /// The list ended, or more than `limit` ids came.
    Done,
    /// Not a list of token ids.
    Malformed,
}

impl TokenPrefix {
    /// Keeps at most `limit + 1` ids.
    pub(super) fn new(limit: usize) -> Self {
        Self { limit, tokens: Vec::new(), current: None, spaced: false, state: TokenState::Before }
    }

    /// Reads the next piece; true once nothing more is needed (the list ended, more than
    /// `limit` ids came, or the answer is not a list of ids).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            match self.state {
                TokenState::Before if b == b'[' => self.state = TokenState::InList,
                TokenState::Before => {}
                TokenState::InList => self.read(b),
                TokenState::Done | TokenState::Malformed => break,
            }
        }
        matches!(self.state, TokenState::Done | TokenState::Malformed)
    }

    fn read(&mut self, b: u8) {
        match b {
            b'0'..=b'9' if self.spaced => self.state = TokenState::Malformed,
            b'0'..=b'9' => {
                let digit = u32::from(b - b'0');
                match self.current.unwrap_or(0).checked_mul(10).and_then(|n| n.checked_add(digit)) {
                    Some(n) => self.current = Some(n),
                    None => self.state = TokenState::Malformed,
                }
            }
            b',' | b']' => {
                self.spaced = false;
                match self.current.take() {
                    Some(id) => self.tokens.push(id),
                    // `[]` is an empty list; `[,` or `1,,2` is not a list of ids.
                    None if b == b']' && self.tokens.is_empty() => {}
                    None => {
                        self.state = TokenState::Malformed;
                        return;
                    }
                }
                if b == b']' || self.tokens.len() > self.limit {
                    self.state = TokenState::Done;
                }
            }
            b' ' | b'\t' | b'\r' | b'\n' => self.spaced = self.current.is_some(),
            _ => self.state = TokenState::Malformed,
        }
    }

    /// `None` when the answer held at most `limit` ids; else the first `limit`.
    pub(super) fn finish(mut self) -> Result<Option<Vec<u32>>, &'static str> {
        match self.state {
            TokenState::Done if self.tokens.len() > self.limit => {
                self.tokens.truncate(self.limit);
                Ok(Some(self.tokens))
            }
            TokenState::Done => Ok(None),
            TokenState::Malformed => Err("not a list of token ids"),
            TokenState::Before | TokenState::InList => Err("a list of token ids cut short"),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{EventScanner, JsonTail, TokenPrefix};

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

    /// What a [`TokenPrefix`] of `limit` makes of `answer` fed in pieces of `piece` bytes.
    fn prefix(answer: &str, limit: usize, piece: usize) -> Result<Option<Vec<u32>>, &'static str> {
        let mut scanner = TokenPrefix::new(limit);
        for chunk in answer.as_bytes().chunks(piece.max(1)) {
            if scanner.feed(chunk) {
                break;
            }
        }
        scanner.finish()
    }

    #[test]
    fn a_token_list_is_read_up_to_its_limit_however_it_is_cut() {
        let answer = r#"{"tokens":[12, 7,4294967295 ,0]}"#;
        for piece in 1..=answer.len() {
            assert_eq!(prefix(answer, 4, piece), Ok(None), "all four fit ({piece})");
            assert_eq!(prefix(answer, 2, piece), Ok(Some(vec![12, 7])), "more than two ({piece})");
            assert_eq!(prefix(answer, 0, piece), Ok(Some(vec![])), "{piece}");
        }
        assert_eq!(prefix(r#"{"tokens":[]}"#, 0, 3), Ok(None));
        // Once past its limit the scanner stops reading: what follows is never looked at.
        assert_eq!(prefix(r#"{"tokens":[1,2,3,oops"#, 1, 1), Ok(Some(vec![1])));
        for wrong in
            [r#"{"tokens":[1,,2]}"#, r#"{"tokens":[1,-2]}"#, r#"{"tokens":[4294967296]}"#, r#"{"tokens":[1 2]}"#]
        {
            assert_eq!(prefix(wrong, 8, 2), Err("not a list of token ids"), "{wrong}");
        }
        for short in [r#"{"tokens":[1,2"#, r#"{"error":"x"}"#, ""] {
            assert_eq!(prefix(short, 8, 2), Err("a list of token ids cut short"), "{short}");
        }
    }

    proptest! {
        #[test]
        fn a_token_prefix_is_the_lists_first_ids(ids in proptest::collection::vec(any::<u32>(), 0..64), limit in 0usize..80, piece in 1usize..16) {
            let answer = json!({ "tokens": ids }).to_string();
            let expected = if ids.len() > limit { Some(ids[..limit].to_vec()) } else { None };
            prop_assert_eq!(prefix(&answer, limit, piece), Ok(expected));
        }
    }
}
