//! The shapes of llama-server's lines that the parser looks for, matched by hand.
//!
//! Each function matches what the regular expression in its comment matches (the tests
//! check that on generated lines). They are written out instead of compiled with the
//! `regex` crate: these few fixed shapes need no engine, and eight compiled expressions
//! with their per-thread caches kept about 200 KiB of the daemon's heap, and the engine's
//! code, resident for its whole life after the first load.

use std::borrow::Cow;

/// `[0-9A-Za-z_]`: llama.cpp's function and variable names are ASCII.
fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Splits off the longest non-empty run of bytes in `class` at the start of `s`.
fn run(s: &str, class: impl Fn(u8) -> bool) -> Option<(&str, &str)> {
    let n = s.bytes().take_while(|&b| class(b)).count();
    // ASCII classes only: `n` is a character boundary.
    (n > 0).then(|| s.split_at(n))
}

/// `[0-9]+`, split off.
fn digits(s: &str) -> Option<(&str, &str)> {
    run(s, |b| b.is_ascii_digit())
}

/// `[0-9]{n}`, skipped.
fn exactly_digits(s: &str, n: usize) -> Option<&str> {
    (s.len() >= n && s.as_bytes()[..n].iter().all(u8::is_ascii_digit)).then(|| &s[n..])
}

/// ` +`, skipped.
fn spaces(s: &str) -> Option<&str> {
    run(s, |b| b == b' ').map(|(_, rest)| rest)
}

/// `\S+`, split off.
fn non_space(s: &str) -> Option<(&str, &str)> {
    let end = s.find(char::is_whitespace).unwrap_or(s.len());
    (end > 0).then(|| s.split_at(end))
}

/// `\s*$`.
fn only_space(s: &str) -> bool {
    s.chars().all(char::is_whitespace)
}

/// `[0-9A-Za-z_]+:`, skipped.
fn function(s: &str) -> Option<&str> {
    run(s, is_word)?.1.strip_prefix(':')
}

/// `^(?:srv +)?` then `rest`, trying with the tag first, as the expression does.
fn after_tag<'a, T>(s: &'a str, rest: impl Fn(&'a str) -> Option<T>) -> Option<T> {
    s.strip_prefix("srv").and_then(spaces).and_then(&rest).or_else(|| rest(s))
}

/// Removes `\x1b\[[0-9;]*[A-Za-z]` (ANSI colour sequences) everywhere.
pub(super) fn strip_colours(line: &str) -> Cow<'_, str> {
    let sequence_len = |at: &str| {
        let body = at.strip_prefix("\x1b[")?;
        let params = body.bytes().take_while(|&b| b.is_ascii_digit() || b == b';').count();
        body.as_bytes().get(params).is_some_and(u8::is_ascii_alphabetic).then_some(2 + params + 1)
    };
    let Some(first) = line.find('\x1b') else { return Cow::Borrowed(line) };
    let mut out = String::new();
    let (mut kept, mut at) = (0, first);
    while let Some(offset) = line[at..].find('\x1b') {
        let start = at + offset;
        match sequence_len(&line[start..]) {
            Some(len) => {
                out.push_str(&line[kept..start]);
                (kept, at) = (start + len, start + len);
            }
            None => at = start + 1,
        }
    }
    if kept == 0 {
        return Cow::Borrowed(line);
    }
    out.push_str(&line[kept..]);
    Cow::Owned(out)
}

/// `^(?:[0-9]+\.[0-9]{2}\.[0-9]{3}\.[0-9]{3} )?([IWED]) `: the level letter and the rest.
pub(super) fn level_prefix(line: &str) -> Option<(&str, &str)> {
    let timestamp = || {
        let rest = digits(line)?.1.strip_prefix('.')?;
        let rest = exactly_digits(rest, 2)?.strip_prefix('.')?;
        let rest = exactly_digits(rest, 3)?.strip_prefix('.')?;
        exactly_digits(rest, 3)?.strip_prefix(' ')
    };
    timestamp().and_then(level_letter).or_else(|| level_letter(line))
}

/// `([IWED]) `: the letter and the rest.
fn level_letter(s: &str) -> Option<(&str, &str)> {
    match s.as_bytes() {
        [b'I' | b'W' | b'E' | b'D', b' ', ..] => Some((&s[..1], &s[2..])),
        _ => None,
    }
}

/// `^\S+\.(?:c|cc|cpp|cu|cuh|h|hpp|m|mm):[0-9]+: `: `GGML_ABORT`'s `path/file.cpp:123: `.
pub(super) fn is_abort(line: &str) -> bool {
    let matches = || {
        // The location is the whole first word: a space must follow it.
        let (location, rest) = non_space(line)?;
        rest.starts_with(' ').then_some(())?;
        let (file, number) = location.strip_suffix(':')?.rsplit_once(':')?;
        (digits(number)?.1.is_empty()).then_some(())?;
        let (stem, extension) = file.rsplit_once('.')?;
        (!stem.is_empty() && matches!(extension, "c" | "cc" | "cpp" | "cu" | "cuh" | "h" | "hpp" | "m" | "mm"))
            .then_some(())
    };
    matches().is_some()
}

/// `^[0-9A-Za-z_]+: +offloaded ([0-9]+)/([0-9]+) layers to GPU\s*$`: the two numbers.
pub(super) fn offload(message: &str) -> Option<(&str, &str)> {
    let rest = spaces(function(message)?)?.strip_prefix("offloaded ")?;
    let (gpu, rest) = digits(rest)?;
    let (total, rest) = digits(rest.strip_prefix('/')?)?;
    only_space(rest.strip_prefix(" layers to GPU")?).then_some((gpu, total))
}

/// A buffer size line's parts, as printed.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Buffer<'a> {
    pub component: &'a str,
    pub name: &'a str,
    pub kind: &'a str,
    pub mib: &'a str,
}

/// `^([0-9A-Za-z_]+): +(\S+) +(model|output|KV|compute|RS) buffer size = +([0-9]+(?:\.[0-9]+)?) MiB\s*$`.
pub(super) fn buffer(message: &str) -> Option<Buffer<'_>> {
    let (component, rest) = run(message, is_word)?;
    let (buffer, rest) = non_space(spaces(rest.strip_prefix(':')?)?)?;
    let (kind, rest) = run(spaces(rest)?, |b| b.is_ascii_alphabetic())?;
    if !matches!(kind, "model" | "output" | "KV" | "compute" | "RS") {
        return None;
    }
    let number = spaces(rest.strip_prefix(" buffer size =")?)?;
    let (whole, mut rest) = digits(number)?;
    let mut len = whole.len();
    if let Some(fraction) = rest.strip_prefix('.') {
        let (fraction, after) = digits(fraction)?;
        (len, rest) = (len + 1 + fraction.len(), after);
    }
    only_space(rest.strip_prefix(" MiB")?).then(|| Buffer { component, name: buffer, kind, mib: &number[..len] })
}

/// `^(?:srv +)?[0-9A-Za-z_]+: model loaded\s*$`.
pub(super) fn model_loaded(message: &str) -> bool {
    after_tag(message, |s| function(s)?.strip_prefix(" model loaded").filter(|rest| only_space(rest))).is_some()
}

/// `^(?:srv +)?[0-9A-Za-z_]+: listening on (\S+)\s*$`: the address.
pub(super) fn listening(message: &str) -> Option<&str> {
    after_tag(message, |s| {
        let (address, rest) = non_space(function(s)?.strip_prefix(" listening on ")?)?;
        only_space(rest).then_some(address)
    })
}

/// `^(?:srv +)?update_slots: all slots are idle\s*$`.
pub(super) fn slots_idle(message: &str) -> bool {
    after_tag(message, |s| s.strip_prefix("update_slots: all slots are idle").filter(|rest| only_space(rest))).is_some()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use regex::Regex;

    use super::*;

    /// The expressions these functions replace, as they were.
    struct Expressions {
        prefix: Regex,
        abort: Regex,
        offload: Regex,
        buffer: Regex,
        model_loaded: Regex,
        listening: Regex,
        slots_idle: Regex,
        ansi: Regex,
    }

    impl Expressions {
        fn new() -> Self {
            let r = |p: &str| Regex::new(p).expect("a valid expression");
            Self {
                prefix: r(r"^(?:[0-9]+\.[0-9]{2}\.[0-9]{3}\.[0-9]{3} )?([IWED]) "),
                abort: r(r"^\S+\.(?:c|cc|cpp|cu|cuh|h|hpp|m|mm):[0-9]+: "),
                offload: r(r"^[0-9A-Za-z_]+: +offloaded ([0-9]+)/([0-9]+) layers to GPU\s*$"),
                buffer: r(
                    r"^([0-9A-Za-z_]+): +(\S+) +(model|output|KV|compute|RS) buffer size = +([0-9]+(?:\.[0-9]+)?) MiB\s*$",
                ),
                model_loaded: r(r"^(?:srv +)?[0-9A-Za-z_]+: model loaded\s*$"),
                listening: r(r"^(?:srv +)?[0-9A-Za-z_]+: listening on (\S+)\s*$"),
                slots_idle: r(r"^(?:srv +)?update_slots: all slots are idle\s*$"),
                ansi: r(r"\x1b\[[0-9;]*[A-Za-z]"),
            }
        }

        /// Checks every function against its expression on `line`.
        fn agree(&self, line: &str) {
            let prefix = self.prefix.captures(line).map(|c| (c.get(1).map_or("", |m| m.as_str()), &line[c[0].len()..]));
            assert_eq!(level_prefix(line), prefix, "level prefix of {line:?}");
            assert_eq!(is_abort(line), self.abort.is_match(line), "abort {line:?}");
            let offload_expected = self
                .offload
                .captures(line)
                .map(|c| (c.get(1).map_or("", |m| m.as_str()), c.get(2).map_or("", |m| m.as_str())));
            assert_eq!(offload(line), offload_expected, "offload {line:?}");
            let buffer_expected = self.buffer.captures(line).map(|c| Buffer {
                component: c.get(1).map_or("", |m| m.as_str()),
                name: c.get(2).map_or("", |m| m.as_str()),
                kind: c.get(3).map_or("", |m| m.as_str()),
                mib: c.get(4).map_or("", |m| m.as_str()),
            });
            assert_eq!(buffer(line), buffer_expected, "buffer {line:?}");
            assert_eq!(model_loaded(line), self.model_loaded.is_match(line), "model loaded {line:?}");
            let listening_expected = self.listening.captures(line).map(|c| c.get(1).map_or("", |m| m.as_str()));
            assert_eq!(listening(line), listening_expected, "listening {line:?}");
            assert_eq!(slots_idle(line), self.slots_idle.is_match(line), "slots idle {line:?}");
            assert_eq!(strip_colours(line), self.ansi.replace_all(line, ""), "colours {line:?}");
        }
    }

    /// Lines of llama-server's shapes, matching and not.
    const LINES: &[&str] = &[
        "0.00.013.600 I load_tensors: offloaded 2/5 layers to GPU",
        "load_tensors: offloaded 0/5 layers to GPU  ",
        "load_tensors:   CPU_Mapped model buffer size =     4.50 MiB",
        "llama_context:        CPU  output buffer size =     0.12 MiB",
        "llama_kv_cache:        CPU KV buffer size =    16 MiB",
        "sched_reserve:      CUDA0 compute buffer size =   104.00 MiB",
        "llama_memory_recurrent:      CPU RS buffer size =     0.02 MiB",
        "load_tensors:   CPU_Mapped model buffer size = 4. MiB",
        "srv  llama_server: model loaded",
        "srv: model loaded",
        "main: model loaded \t",
        "srv  llama_server: listening on http://127.0.0.1:39111",
        "srv  llama_server: listening on  http://127.0.0.1:39111",
        "srv  update_slots: all slots are idle",
        "update_slots: all slots are idle",
        "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error",
        "ggml.c:123: GGML_ASSERT",
        ".c:1: x",
        "a.c:1:\tx",
        "I load_tensors: no timestamp",
        "0.00.001.142 I",
        "\x1b[34m0.00.011.183\x1b[0m \x1b[32mI \x1b[0mload_tensors: offloaded 2/5 layers to GPU",
        "\x1b\x1b[1mbold\x1b[",
        "",
    ];

    /// What the lines are built from, and what is put into them.
    const PIECES: &[&str] = &[
        "0",
        "12",
        "345",
        ".",
        ":",
        "/",
        " ",
        "  ",
        "\t",
        "\u{a0}",
        "\u{2003}",
        "é",
        "I ",
        "E ",
        "X ",
        "0.00.013.600 ",
        "srv ",
        "srv  ",
        "load_tensors:",
        "update_slots:",
        " offloaded ",
        " layers to GPU",
        "CPU_Mapped",
        " model",
        " KV",
        " RS",
        " buffer size =",
        " MiB",
        " model loaded",
        " listening on ",
        " all slots are idle",
        "file.cpp",
        ".cu",
        ".rs",
        "\x1b[",
        "\x1b",
        "0;31",
        "m",
        ";",
    ];

    /// A line of llama-server's with pieces put in, at the start, at a point inside, and
    /// at the end: most are near misses of a shape, some still match it.
    fn line() -> impl Strategy<Value = String> {
        let piece = || prop::sample::select(PIECES).prop_map(str::to_owned);
        let pieces = move |max: usize| prop::collection::vec(piece(), 0..max).prop_map(|p| p.concat());
        (prop::sample::select(LINES), any::<prop::sample::Index>(), pieces(3), pieces(3), pieces(3)).prop_map(
            |(line, at, before, inside, after)| {
                let mut at = at.index(line.len() + 1);
                while !line.is_char_boundary(at) {
                    at -= 1;
                }
                format!("{before}{}{inside}{}{after}", &line[..at], &line[at..])
            },
        )
    }

    fn expressions() -> &'static Expressions {
        static EXPRESSIONS: std::sync::OnceLock<Expressions> = std::sync::OnceLock::new();
        EXPRESSIONS.get_or_init(Expressions::new)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn each_shape_matches_what_its_expression_matches(line in line()) {
            expressions().agree(&line);
        }
    }

    #[test]
    fn each_shape_matches_llama_server_s_lines_as_its_expression_does() {
        for line in LINES {
            expressions().agree(line);
        }
    }
}
