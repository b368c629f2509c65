//! Modelfiles, as `ollama create` reads them: `FROM`, `PARAMETER`, `TEMPLATE`, `SYSTEM`,
//! `ADAPTER`, `LICENSE`, `MESSAGE`, with `#` comments; and the writer `/api/show` uses,
//! whose output reads back as exactly the Modelfile it wrote, whatever the text.
//!
//! # Values
//!
//! A value runs from the instruction (and a `PARAMETER`'s name or a `MESSAGE`'s role)
//! to the end of its line, trimmed, unless it starts with a quote:
//!
//! - `"""text"""` is raw: no escapes, and it may span lines. As in Ollama, it ends at the
//!   first line end where what came after the opening `"""` ends, trailing white space
//!   aside, with `"""`; so `"""` inside the text ends it only at the end of a line.
//! - `"text"` ends the same way at a line end after a `"`. Inside it, `\\`, `\"`, `\n`,
//!   `\r`, `\t` and `\u{1F600}` (1 to 6 hex digits) are escapes; a backslash before
//!   anything else is kept as written (Ollama keeps every backslash, so a Modelfile
//!   written for Ollama reads the same unless it has one of these six sequences in a
//!   `"` value).
//!
//! The writer picks, for each text, the first form that reads back as the same text:
//! `"text"` for a simple line, `"""text"""` for lines without control characters and
//! without `"""` at a line end, and otherwise one line `"…"` with escapes. That last
//! form is one line, so even a parser without escapes (Ollama's) reads no instruction
//! out of the text. Every written Modelfile is parsed back and compared before it is
//! returned.
//!
//! # Limits
//!
//! A Modelfile comes from a client: the parser refuses one over [`MAX_BYTES`],
//! [`MAX_LINES`] lines or [`MAX_INSTRUCTIONS`] instructions, keeps no per-line index,
//! and never panics. Every error names its line.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use serde_json::Value;

/// The largest Modelfile read, in bytes: far above what a model the store accepts needs
/// (its text and JSON layers are at most 4 MiB together; escapes at most quintuple that).
pub const MAX_BYTES: usize = 32 << 20;
/// The most lines a Modelfile may have.
pub const MAX_LINES: usize = 8 << 20;
/// The most instructions a Modelfile may have.
pub const MAX_INSTRUCTIONS: usize = 1 << 18;

/// A parsed Modelfile.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Modelfile {
    /// `FROM`: a GGUF path, a model name or a blob digest.
    pub from: String,
    /// `PARAMETER`s, typed; `stop` accumulates into a list.
    pub parameters: BTreeMap<String, Value>,
    /// `TEMPLATE`.
    pub template: Option<String>,
    /// `SYSTEM`.
    pub system: Option<String>,
    /// `ADAPTER`s: GGUF paths or blob digests.
    pub adapters: Vec<String>,
    /// `LICENSE`s.
    pub licenses: Vec<String>,
    /// `MESSAGE`s.
    pub messages: Vec<Message>,
}

/// A preset conversation message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// A Modelfile error and where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Modelfile{}: {message}", at_line(*line))]
pub struct ModelfileError {
    /// The 1-based line number; 0 for the Modelfile as a whole.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

fn at_line(line: usize) -> String {
    if line == 0 { String::new() } else { format!(" line {line}") }
}

/// Why a model cannot be written as a Modelfile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this model cannot be written as a Modelfile: {0}")]
pub struct WriteError(String);

/// The type of a parameter's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Bool,
    Strings,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Int => "an integer",
            Self::Float => "a number",
            Self::Bool => "true or false",
            Self::Strings => "a string",
        })
    }
}

/// The parameters Ollama's option schema accepts, with their types.
const PARAMETERS: &[(&str, Kind)] = &[
    ("num_ctx", Kind::Int),
    ("num_batch", Kind::Int),
    ("num_gpu", Kind::Int),
    ("main_gpu", Kind::Int),
    ("num_thread", Kind::Int),
    ("num_keep", Kind::Int),
    ("num_predict", Kind::Int),
    ("seed", Kind::Int),
    ("top_k", Kind::Int),
    ("repeat_last_n", Kind::Int),
    ("use_mmap", Kind::Bool),
    ("temperature", Kind::Float),
    ("top_p", Kind::Float),
    ("min_p", Kind::Float),
    ("typical_p", Kind::Float),
    ("repeat_penalty", Kind::Float),
    ("presence_penalty", Kind::Float),
    ("frequency_penalty", Kind::Float),
    ("stop", Kind::Strings),
];

/// The names of the parameters a Modelfile may set.
pub fn parameter_names() -> impl Iterator<Item = &'static str> {
    PARAMETERS.iter().map(|(name, _)| *name)
}

fn kind_of(key: &str) -> Option<Kind> {
    PARAMETERS.iter().find(|(name, _)| *name == key).map(|(_, kind)| *kind)
}

/// The roles a `MESSAGE` may have.
const ROLES: [&str; 3] = ["system", "user", "assistant"];

const TRIPLE: &str = "\"\"\"";

/// The lines of a text, split at `\n` with a `\r` before it dropped; counted and capped.
struct Lines<'a> {
    rest: Option<&'a str>,
    number: usize,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str) -> Self {
        Self { rest: (!text.is_empty()).then_some(text), number: 0 }
    }

    fn next(&mut self) -> Result<Option<(usize, &'a str)>, ModelfileError> {
        let Some(rest) = self.rest else { return Ok(None) };
        self.number += 1;
        if self.number > MAX_LINES {
            return Err(ModelfileError { line: self.number, message: format!("more than {MAX_LINES} lines") });
        }
        let (line, next) = match rest.find('\n') {
            Some(end) => (&rest[..end], Some(&rest[end + 1..]).filter(|r| !r.is_empty())),
            None => (rest, None),
        };
        self.rest = next;
        Ok(Some((self.number, line.strip_suffix('\r').unwrap_or(line))))
    }
}

fn split_word(s: &str) -> (&str, &str) {
    s.split_once(char::is_whitespace).unwrap_or((s, ""))
}

impl Modelfile {
    /// Parses Modelfile text.
    pub fn parse(text: &str) -> Result<Self, ModelfileError> {
        Self::parse_located(text).map(|(modelfile, _)| modelfile)
    }

    /// [`Modelfile::parse`], also saying on which lines the `FROM` (first) and the
    /// `ADAPTER`s (in order) are, for messages about their files.
    pub fn parse_located(text: &str) -> Result<(Self, Vec<usize>), ModelfileError> {
        let mut source_lines = Vec::new();
        if text.len() > MAX_BYTES {
            return Err(ModelfileError {
                line: 0,
                message: format!("it is {} bytes, more than the limit of {MAX_BYTES}", text.len()),
            });
        }
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut out = Self::default();
        let mut from_line = None;
        let mut instructions = 0;
        let mut lines = Lines::new(text);
        while let Some((number, line)) = lines.next()? {
            let fail = |message: String| ModelfileError { line: number, message };
            let line = line.trim_start();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            instructions += 1;
            if instructions > MAX_INSTRUCTIONS {
                return Err(fail(format!("more than {MAX_INSTRUCTIONS} instructions")));
            }
            let (instruction, rest) = split_word(line);
            let instruction = instruction.to_ascii_uppercase();
            match instruction.as_str() {
                "FROM" => {
                    let value = read_value(rest, &mut lines, number)?;
                    if let Some(first) = from_line {
                        return Err(fail(format!("a second FROM (the first is on line {first})")));
                    }
                    out.from = non_empty("FROM", value).map_err(fail)?;
                    from_line = Some(number);
                    source_lines.insert(0, number);
                }
                "PARAMETER" => {
                    let (key, rest) = split_word(rest.trim_start());
                    if key.is_empty() || rest.trim().is_empty() {
                        return Err(fail(
                            "PARAMETER needs a name and a value, like `PARAMETER temperature 0.7`".to_owned(),
                        ));
                    }
                    let kind = kind_of(key).ok_or_else(|| fail(format!("unknown parameter \"{key}\"")))?;
                    let raw = read_value(rest, &mut lines, number)?;
                    let typed =
                        typed(kind, &raw).ok_or_else(|| fail(format!("{key} must be {kind}, not \"{raw}\"")))?;
                    if kind == Kind::Strings {
                        let list = out.parameters.entry(key.to_owned()).or_insert_with(|| Value::Array(Vec::new()));
                        if let Value::Array(items) = list {
                            items.push(typed);
                        }
                    } else {
                        out.parameters.insert(key.to_owned(), typed);
                    }
                }
                "TEMPLATE" => out.template = Some(read_value(rest, &mut lines, number)?),
                "SYSTEM" => out.system = Some(read_value(rest, &mut lines, number)?),
                "ADAPTER" => {
                    let value = read_value(rest, &mut lines, number)?;
                    out.adapters.push(non_empty("ADAPTER", value).map_err(fail)?);
                    source_lines.push(number);
                }
                "LICENSE" => out.licenses.push(read_value(rest, &mut lines, number)?),
                "MESSAGE" => {
                    let (role, rest) = split_word(rest.trim_start());
                    if !ROLES.contains(&role) {
                        return Err(fail(format!("MESSAGE role must be system, user or assistant, not \"{role}\"")));
                    }
                    let content = read_value(rest, &mut lines, number)?;
                    out.messages.push(Message { role: role.to_owned(), content });
                }
                other => return Err(fail(format!("unknown instruction \"{other}\""))),
            }
        }
        if from_line.is_none() {
            return Err(ModelfileError { line: lines.number.max(1), message: "no FROM instruction".to_owned() });
        }
        Ok((out, source_lines))
    }

    /// The `params` layer's JSON: the parameters as an object.
    #[must_use]
    pub fn params_json(&self) -> Option<Vec<u8>> {
        (!self.parameters.is_empty()).then(|| serde_json::to_vec(&self.parameters).expect("a JSON map serializes"))
    }

    /// Writes this Modelfile as text that [`Modelfile::parse`] reads back as exactly this
    /// Modelfile, after `header` (comment lines). Refuses what the syntax cannot say: an
    /// empty `FROM`, a parameter a Modelfile cannot set or of the wrong type, a message
    /// role other than system, user or assistant.
    pub fn write(&self, header: &str) -> Result<String, WriteError> {
        let mut out = String::new();
        for line in header.lines() {
            let _ = writeln!(out, "# {}", escape_line(line));
        }
        if !header.is_empty() {
            out.push('\n');
        }
        let _ = writeln!(out, "FROM {}", source(&self.from, "FROM")?);
        for adapter in &self.adapters {
            let _ = writeln!(out, "ADAPTER {}", source(adapter, "ADAPTER")?);
        }
        if let Some(template) = &self.template {
            let _ = writeln!(out, "TEMPLATE {}", quote(template));
        }
        if let Some(system) = &self.system {
            let _ = writeln!(out, "SYSTEM {}", quote(system));
        }
        for (key, value) in &self.parameters {
            for shown in parameter(key, value)? {
                let _ = writeln!(out, "PARAMETER {key} {shown}");
            }
        }
        for license in &self.licenses {
            let _ = writeln!(out, "LICENSE {}", quote(license));
        }
        for message in &self.messages {
            if !ROLES.contains(&message.role.as_str()) {
                return Err(WriteError(format!(
                    "a message's role is {:?}; a Modelfile's MESSAGE takes system, user or assistant",
                    message.role
                )));
            }
            let _ = writeln!(out, "MESSAGE {} {}", message.role, quote(&message.content));
        }
        // The guarantee, checked: what was written reads back as this Modelfile.
        match Self::parse(&out) {
            Ok(back) if back == *self => Ok(out),
            Ok(_) => Err(WriteError("its text does not read back the same (a bug in the writer)".to_owned())),
            Err(e) => Err(WriteError(format!("the Modelfile would not read back: {e}"))),
        }
    }
}

/// An instruction's value (`rest`: the line after the instruction): to the end of the
/// line, or a `"""` or `"` block over one or more lines.
fn read_value(rest: &str, lines: &mut Lines<'_>, number: usize) -> Result<String, ModelfileError> {
    let value = rest.trim_start();
    if let Some(after) = value.strip_prefix(TRIPLE) {
        block(after, TRIPLE, lines, number)
    } else if let Some(after) = value.strip_prefix('"') {
        block(after, "\"", lines, number).map(|text| unescape(&text))
    } else {
        Ok(value.trim_end().to_owned())
    }
}

/// Whether a line (of a block) ends the block: it ends with `quote`, white space aside.
fn closes(line: &str, quote: &str) -> bool {
    line.trim_end().ends_with(quote)
}

/// A quoted value's text: from `first` (the rest of the line after the opening quote)
/// to the closing `quote` at the end of a line.
fn block(first: &str, quote: &str, lines: &mut Lines<'_>, number: usize) -> Result<String, ModelfileError> {
    let mut text = String::new();
    let mut line = first;
    loop {
        if closes(line, quote) {
            let line = line.trim_end();
            text.push_str(&line[..line.len() - quote.len()]);
            return Ok(text);
        }
        text.push_str(line);
        match lines.next()? {
            Some((_, next)) => {
                text.push('\n');
                line = next;
            }
            None => {
                return Err(ModelfileError { line: number, message: format!("a {quote} value is never closed") });
            }
        }
    }
}

/// A `"` value's escapes decoded; a backslash before anything else stays.
fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (decoded, used) = match after.chars().next() {
            Some('\\') => (Some('\\'), 1),
            Some('"') => (Some('"'), 1),
            Some('n') => (Some('\n'), 1),
            Some('r') => (Some('\r'), 1),
            Some('t') => (Some('\t'), 1),
            Some('u') => unicode_escape(&after[1..]).map_or((None, 0), |(c, used)| (Some(c), 1 + used)),
            _ => (None, 0),
        };
        match decoded {
            Some(c) => out.push(c),
            None => out.push('\\'),
        }
        rest = &after[used..];
    }
    out.push_str(rest);
    out
}

/// `{1F600}` at the start of `text`: the character and the bytes it took.
fn unicode_escape(text: &str) -> Option<(char, usize)> {
    let inner = text.strip_prefix('{')?;
    // The `}` is looked for among the next seven bytes only (six digits at most): looked
    // for to the end, a value of many `\u{` without one took the square of its length.
    let end = inner.bytes().take(7).position(|b| b == b'}')?;
    let hex = &inner[..end];
    if hex.is_empty() || hex.len() > 6 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let c = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
    Some((c, end + 2))
}

/// `text` as a value that reads back as exactly `text` (see the module documentation).
fn quote(text: &str) -> String {
    let plain = |c: char| !c.is_control() || c == '\t';
    // `"` first would make `""…` or `"""`, another form.
    let simple = !text.contains(['\n', '\\']) && text.chars().all(plain) && !text.starts_with('"');
    if simple {
        return format!("\"{text}\"");
    }
    let raw = text.chars().all(|c| plain(c) || c == '\n') && {
        // The block must end only at its own closing quotes: no line of the text (but the
        // last, which they follow) may end with `"""`.
        let mut lines: Vec<&str> = text.split('\n').collect();
        lines.pop();
        !lines.iter().any(|line| closes(line, TRIPLE))
    };
    if raw {
        return format!("{TRIPLE}{text}{TRIPLE}");
    }
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A `FROM` or `ADAPTER` value: as is when it reads back so, else quoted.
fn source(value: &str, instruction: &str) -> Result<String, WriteError> {
    if value.trim().is_empty() {
        return Err(WriteError(format!("its {instruction} is empty")));
    }
    let bare = value == value.trim() && !value.starts_with('"') && !value.chars().any(char::is_control);
    Ok(if bare { value.to_owned() } else { quote(value) })
}

/// A comment's text on one line.
fn escape_line(line: &str) -> String {
    line.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// A parameter's values as `PARAMETER` writes them (one per line for a list).
fn parameter(key: &str, value: &Value) -> Result<Vec<String>, WriteError> {
    let wrong = || WriteError(format!("parameter {key:?} has the value {value}, which a Modelfile cannot set"));
    let kind = kind_of(key).ok_or_else(|| {
        WriteError(format!("{key:?} is not a parameter a Modelfile can set (those are {})", names_list()))
    })?;
    let shown = match (kind, value) {
        (Kind::Int, Value::Number(n)) if n.is_i64() => n.to_string(),
        // Integers stay integers and floats floats: the parser keeps the difference.
        (Kind::Float, Value::Number(n)) if n.is_i64() || n.is_f64() => n.to_string(),
        (Kind::Bool, Value::Bool(b)) => b.to_string(),
        (Kind::Strings, Value::Array(items)) if !items.is_empty() => {
            return items.iter().map(|item| item.as_str().map(quote).ok_or_else(wrong)).collect();
        }
        _ => return Err(wrong()),
    };
    Ok(vec![shown])
}

fn names_list() -> String {
    parameter_names().collect::<Vec<_>>().join(", ")
}

fn non_empty(instruction: &str, value: String) -> Result<String, String> {
    if value.trim().is_empty() { Err(format!("{instruction} needs a value")) } else { Ok(value) }
}

fn typed(kind: Kind, raw: &str) -> Option<Value> {
    match kind {
        Kind::Int => raw.parse::<i64>().ok().map(Value::from),
        // An integer stays one, so a model's `1` reads back as `1` and not `1.0`.
        Kind::Float => raw
            .parse::<i64>()
            .ok()
            .map(Value::from)
            .or_else(|| raw.parse::<f64>().ok().filter(|f| f.is_finite()).map(Value::from)),
        Kind::Bool => raw.parse::<bool>().ok().map(Value::from),
        Kind::Strings => Some(Value::from(raw)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::{MAX_BYTES, MAX_INSTRUCTIONS, Message, Modelfile, quote};

    #[test]
    fn every_instruction_is_read() {
        let m = Modelfile::parse(
            r#"# a comment
FROM ./tiny.gguf
PARAMETER temperature 0.7
PARAMETER num_ctx 2048
parameter stop "<|im_end|>"
PARAMETER stop </s>
PARAMETER use_mmap false
TEMPLATE """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}"""
SYSTEM You are terse.
ADAPTER ./lora.gguf
LICENSE """MIT"""
LICENSE Apache-2.0
MESSAGE user "Hi"
MESSAGE assistant Hello there
MESSAGE user """two
lines"""
"#,
        )
        .expect("valid");
        assert_eq!(m.from, "./tiny.gguf");
        assert_eq!(
            serde_json::to_value(&m.parameters).expect("json"),
            json!({"temperature": 0.7, "num_ctx": 2048, "stop": ["<|im_end|>", "</s>"], "use_mmap": false})
        );
        assert_eq!(
            m.template.as_deref(),
            Some("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}")
        );
        assert_eq!(m.system.as_deref(), Some("You are terse."));
        assert_eq!(m.adapters, ["./lora.gguf"]);
        assert_eq!(m.licenses, ["MIT", "Apache-2.0"]);
        assert_eq!(
            m.messages,
            [
                Message { role: "user".into(), content: "Hi".into() },
                Message { role: "assistant".into(), content: "Hello there".into() },
                Message { role: "user".into(), content: "two\nlines".into() }
            ]
        );
        assert!(m.params_json().is_some());
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("PARAMETER temperature 0.7\n", 1, "no FROM instruction"),
            ("FROM a\nFROM b\n", 2, "a second FROM (the first is on line 1)"),
            ("FROM a\n\nPARAMETER temprature 1\n", 3, "unknown parameter \"temprature\""),
            ("FROM a\nPARAMETER num_ctx lots\n", 2, "num_ctx must be an integer, not \"lots\""),
            ("FROM a\nPARAMETER top_p nan\n", 2, "top_p must be a number"),
            ("FROM a\nPARAMETER use_mmap yes\n", 2, "use_mmap must be true or false"),
            ("FROM a\nPARAMETER seed\n", 2, "PARAMETER needs a name and a value"),
            ("FROM a\nQUANTIZE q4\n", 2, "unknown instruction \"QUANTIZE\""),
            ("FROM a\nMESSAGE bot hi\n", 2, "MESSAGE role must be system, user or assistant"),
            ("FROM a\nTEMPLATE \"\"\"never\nclosed\n", 2, "never closed"),
            ("FROM\n", 1, "FROM needs a value"),
            ("FROM a\nADAPTER \"\"\n", 2, "ADAPTER needs a value"),
        ];
        for (text, line, message) in cases {
            let err = Modelfile::parse(text).expect_err(text);
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.message.contains(message), "{text:?}: {err}");
            assert!(err.to_string().starts_with(&format!("Modelfile line {line}: ")));
        }
    }

    #[test]
    fn multi_line_values_keep_their_line_count() {
        let err = Modelfile::parse("FROM a\nSYSTEM \"\"\"one\ntwo\nthree\"\"\"\nPARAMETER bad 1\n").expect_err("bad");
        assert_eq!(err.line, 5);
    }

    /// Texts that broke the old writer or read differently than written.
    const ATTACKS: &[&str] = &[
        "\"\"\"\nFROM /etc/shadow\n\"\"\"",
        "\"\"\"\nFROM /etc/shadow\nSYSTEM \"\"\"",
        "ok\"\"\"\nADAPTER /etc/shadow\nLICENSE \"\"\"x",
        "end with quotes\"\"\"",
        "end with quotes \"\"\"   ",
        "\"\"\"",
        "\"",
        "\"\"",
        "\"quoted\"",
        "",
        " ",
        "  leading and trailing  ",
        "\n\nleading newlines",
        "trailing newlines\n\n",
        "\n",
        "line\r\nwith CRLF\rand CR",
        "NUL \0 and \u{1b}[31m escapes \u{7f} \u{85}",
        "PARAMETER num_ctx 99999999\nFROM evil",
        "# not a comment\n#also not",
        "back\\slash \\\" \\n \\u{41} \\",
        "tab\tseparated\t",
        "unicode ☃ 日本語 \u{2028} line separator \u{feff} bom \u{3000}",
        "line ends with quotes and unicode space \"\"\"\u{3000}\nFROM x",
        "{{ \"\\n\" }}{{ .System }}",
    ];

    fn every_field(text: &str) -> Modelfile {
        let mut parameters = BTreeMap::new();
        parameters.insert("stop".to_owned(), json!([text, "</s>"]));
        parameters.insert("temperature".to_owned(), json!(0.7));
        Modelfile {
            from: "/models/blobs/sha256-00".into(),
            parameters,
            template: Some(text.into()),
            system: Some(text.into()),
            adapters: vec!["/a b/adapter.gguf".into()],
            licenses: vec![text.into(), "MIT".into()],
            messages: vec![
                Message { role: "user".into(), content: text.into() },
                Message { role: "assistant".into(), content: text.into() },
            ],
        }
    }

    #[test]
    fn hostile_texts_are_written_so_they_read_back_the_same() {
        for text in ATTACKS {
            let m = every_field(text);
            let written = m.write("Modelfile generated by corral").unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(Modelfile::parse(&written).expect("reads back"), m, "{text:?}:\n{written}");
        }
        // The attack of the issue: a system prompt that closes its quotes and names a file.
        let text = "\"\"\"\nFROM /etc/shadow\n\"\"\"";
        let written = every_field(text).write("").expect("write");
        assert!(written.contains("SYSTEM \"\\\"\\\"\\\"\\nFROM /etc/shadow\\n\\\"\\\"\\\"\"\n"), "{written}");
        assert!(!written.lines().any(|l| l.trim() == "FROM /etc/shadow"), "{written}");
    }

    #[test]
    fn the_writer_picks_the_plainest_form_that_reads_back() {
        assert_eq!(quote("<|im_end|>"), "\"<|im_end|>\"");
        assert_eq!(quote("say \"hi\""), "\"say \"hi\"\"");
        assert_eq!(quote("{{ .Prompt }}\n{{ .Response }}"), "\"\"\"{{ .Prompt }}\n{{ .Response }}\"\"\"");
        assert_eq!(quote("C:\\path"), "\"\"\"C:\\path\"\"\"");
        assert_eq!(quote("a\"\"\"\nb"), "\"a\\\"\\\"\\\"\\nb\"");
        assert_eq!(quote("nul\0"), "\"nul\\u{0}\"");
    }

    #[test]
    fn ollamas_quoting_reads_as_in_ollama() {
        let m = Modelfile::parse(
            "FROM foo\nSYSTEM \"\"\"\nThis is a\nmultiline system.\n\"\"\"\nLICENSE \"\"\"   spaces   \"\"\"   \n\
             MESSAGE user \"line one\nline two\"\nTEMPLATE \"\"\"a\"\"\"b\"\"\"\nPARAMETER stop \"\"\"### User:\n\"\"\"\n\
             PARAMETER stop \"### User: \"\nPARAMETER stop ### User: \n",
        )
        .expect("valid");
        assert_eq!(m.system.as_deref(), Some("\nThis is a\nmultiline system.\n"));
        assert_eq!(m.licenses, ["   spaces   "]);
        assert_eq!(m.messages[0].content, "line one\nline two");
        assert_eq!(m.template.as_deref(), Some("a\"\"\"b"));
        assert_eq!(m.parameters["stop"], json!(["### User:\n", "### User: ", "### User:"]));
        // A backslash that is not one of the escapes stays, as Ollama keeps it.
        let m = Modelfile::parse("FROM x\nSYSTEM \"C:\\Users\\me \\d+\"\nTEMPLATE \"\"\"{{ \"\\n\" }}\"\"\"\n")
            .expect("ok");
        assert_eq!(m.system.as_deref(), Some("C:\\Users\\me \\d+"));
        assert_eq!(m.template.as_deref(), Some("{{ \"\\n\" }}"));
        // A BOM and CRLF line ends.
        let m = Modelfile::parse("\u{feff}FROM x\r\nSYSTEM \"\"\"a\r\nb\"\"\"\r\n").expect("ok");
        assert_eq!((m.from.as_str(), m.system.as_deref()), ("x", Some("a\nb")));
    }

    #[test]
    fn what_a_modelfile_cannot_say_is_refused() {
        let base = Modelfile { from: "x".into(), ..Modelfile::default() };
        let cases: Vec<(Modelfile, &str)> = vec![
            (Modelfile { from: " ".into(), ..base.clone() }, "its FROM is empty"),
            (
                Modelfile { messages: vec![Message { role: "tool".into(), content: "x".into() }], ..base.clone() },
                "a message's role is \"tool\"",
            ),
            (
                Modelfile { parameters: [("mirostat".to_owned(), json!(2))].into(), ..base.clone() },
                "\"mirostat\" is not a parameter a Modelfile can set",
            ),
            (
                Modelfile { parameters: [("stop\nFROM /etc/shadow".to_owned(), json!(["x"]))].into(), ..base.clone() },
                "is not a parameter a Modelfile can set",
            ),
            (
                Modelfile { parameters: [("num_ctx".to_owned(), json!("4096\nFROM x"))].into(), ..base.clone() },
                "parameter \"num_ctx\" has the value",
            ),
            (Modelfile { parameters: [("seed".to_owned(), json!(u64::MAX))].into(), ..base.clone() }, "seed"),
            (Modelfile { parameters: [("stop".to_owned(), json!([]))].into(), ..base.clone() }, "stop"),
            (Modelfile { parameters: [("stop".to_owned(), json!("one"))].into(), ..base.clone() }, "stop"),
        ];
        for (m, message) in cases {
            let err = m.write("").expect_err(message).to_string();
            assert!(err.starts_with("this model cannot be written as a Modelfile: "), "{err}");
            assert!(err.contains(message), "{err}");
        }
    }

    #[test]
    fn numbers_keep_their_type() {
        let m = Modelfile::parse("FROM x\nPARAMETER temperature 1\nPARAMETER top_p 1.0\nPARAMETER seed -1\n")
            .expect("valid");
        assert_eq!(serde_json::to_string(&m.parameters).expect("json"), r#"{"seed":-1,"temperature":1,"top_p":1.0}"#);
        assert_eq!(Modelfile::parse(&m.write("").expect("write")).expect("back"), m);
    }

    /// A `"` value of two million `\u{` with no `}` parses in one pass, each kept as it
    /// was written (each looked for its `}` to the value's end, hours for 8 MB).
    #[test]
    fn unclosed_unicode_escapes_are_kept_in_one_pass() {
        let escapes = "\\u{".repeat(2_000_000);
        let m = Modelfile::parse(&format!("FROM x\nSYSTEM \"{escapes}\"\n")).expect("valid");
        assert_eq!(m.system.as_deref(), Some(escapes.as_str()));
        let m = Modelfile::parse("FROM x\nSYSTEM \"\\u{1F600}\\u{1234567}\\u{}\"\n").expect("valid");
        assert_eq!(m.system.as_deref(), Some("\u{1F600}\\u{1234567}\\u{}"));
    }

    #[test]
    fn client_modelfiles_are_bounded() {
        let big = format!("FROM x\nSYSTEM {}\n", "a".repeat(MAX_BYTES));
        let err = Modelfile::parse(&big).expect_err("too big");
        assert!(err.to_string().starts_with("Modelfile: it is "), "{err}");
        assert!(err.to_string().contains("more than the limit of 33554432"), "{err}");
        let many = format!("FROM x\n{}", "LICENSE a\n".repeat(MAX_INSTRUCTIONS));
        let err = Modelfile::parse(&many).expect_err("too many");
        assert_eq!(err.line, MAX_INSTRUCTIONS + 1);
        assert!(err.message.contains("more than 262144 instructions"), "{err}");
        // Lines, empty ones counted: one past the bound, within the bytes.
        let lines = format!("FROM x\n{}", "\n".repeat(super::MAX_LINES));
        let err = Modelfile::parse(&lines).expect_err("too many lines");
        assert_eq!((err.line, err.message.as_str()), (super::MAX_LINES + 1, "more than 8388608 lines"), "{err}");
        assert!(Modelfile::parse(&format!("FROM x\n{}", "\n".repeat(super::MAX_LINES - 2))).is_ok());
        // A block never closed over many lines reads each line once (no quadratic rescans).
        let open = format!("FROM x\nSYSTEM \"\"\"{}", "\n".repeat(1 << 20));
        assert!(Modelfile::parse(&open).expect_err("open").message.contains("never closed"));
    }

    /// Text with the characters that matter to the syntax over-represented.
    fn text() -> BoxedStrategy<String> {
        let piece = prop_oneof![
            Just("\"".to_owned()),
            Just("\"\"\"".to_owned()),
            Just("\\".to_owned()),
            Just("\n".to_owned()),
            Just("\r".to_owned()),
            Just(" ".to_owned()),
            Just("\t".to_owned()),
            Just("#".to_owned()),
            Just("\u{3000}".to_owned()),
            Just("\\u{41}".to_owned()),
            Just("FROM /etc/shadow".to_owned()),
            Just("PARAMETER ".to_owned()),
            any::<char>().prop_map(String::from),
            "[a-z]{1,4}",
        ];
        prop::collection::vec(piece, 0..12).prop_map(|pieces| pieces.concat()).boxed()
    }

    fn number() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ]
    }

    fn modelfile() -> impl Strategy<Value = Modelfile> {
        let source = text().prop_filter("not empty", |s| !s.trim().is_empty());
        let role = prop::sample::select(vec!["system", "user", "assistant"]);
        (
            (source.clone(), prop::collection::vec(source, 0..2)),
            (prop::option::of(text()), prop::option::of(text())),
            prop::collection::vec(text(), 0..3),
            prop::collection::vec((role, text()), 0..3),
            (prop::option::of(any::<i64>()), prop::option::of(number()), prop::option::of(any::<bool>())),
            prop::collection::vec(text(), 0..3),
        )
            .prop_map(
                |((from, adapters), (template, system), licenses, messages, (seed, top_p, mmap), stops)| {
                    let mut parameters = BTreeMap::new();
                    if let Some(seed) = seed {
                        parameters.insert("seed".to_owned(), Value::from(seed));
                    }
                    if let Some(top_p) = top_p {
                        parameters.insert("top_p".to_owned(), top_p);
                    }
                    if let Some(mmap) = mmap {
                        parameters.insert("use_mmap".to_owned(), Value::from(mmap));
                    }
                    if !stops.is_empty() {
                        parameters.insert("stop".to_owned(), Value::from(stops));
                    }
                    let messages = messages
                        .into_iter()
                        .map(|(role, content)| Message { role: role.to_owned(), content })
                        .collect();
                    Modelfile { from, parameters, template, system, adapters, licenses, messages }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn whatever_is_written_reads_back_the_same(m in modelfile(), header in text()) {
            let written = m.write(&header).expect("every text can be written");
            prop_assert_eq!(Modelfile::parse(&written).expect("reads back"), m);
        }

        #[test]
        fn any_text_is_one_value(t in text()) {
            let line = format!("FROM x\nSYSTEM {}\n", quote(&t));
            let m = Modelfile::parse(&line).expect("reads");
            prop_assert_eq!(m.system.as_deref(), Some(t.as_str()));
        }

        #[test]
        fn the_parser_never_panics(input in ".{0,400}", pieces in prop::collection::vec(text(), 0..8)) {
            let _ = Modelfile::parse(&input);
            let _ = Modelfile::parse(&pieces.join("\n"));
            let _ = Modelfile::parse(&format!("FROM x\n{}", pieces.join("\n")));
        }
    }
}
