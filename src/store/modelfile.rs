//! Modelfiles, as `ollama create` reads them: `FROM`, `PARAMETER`, `TEMPLATE`, `SYSTEM`,
//! `ADAPTER`, `LICENSE`, `MESSAGE`, with `#` comments and `"""` multi-line values.
//! Every error names its line.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

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
#[error("Modelfile line {line}: {message}")]
pub struct ModelfileError {
    /// The 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

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

impl Modelfile {
    /// Parses Modelfile text.
    pub fn parse(text: &str) -> Result<Self, ModelfileError> {
        let mut out = Self::default();
        let mut from_line = None;
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let number = i + 1;
            let fail = |message: String| ModelfileError { line: number, message };
            let line = lines[i].trim();
            i += 1;
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let instruction = instruction.to_ascii_uppercase();
            // MESSAGE's value follows its role: `MESSAGE user """…"""`.
            let (role, rest) = if instruction == "MESSAGE" {
                rest.trim_start().split_once(char::is_whitespace).unwrap_or((rest.trim(), ""))
            } else {
                ("", rest)
            };
            let (value, consumed) = value(rest.trim_start(), &lines[i..]).map_err(fail)?;
            i += consumed;
            match instruction.as_str() {
                "FROM" => {
                    if let Some(first) = from_line {
                        return Err(fail(format!("a second FROM (the first is on line {first})")));
                    }
                    out.from = non_empty("FROM", value).map_err(fail)?;
                    from_line = Some(number);
                }
                "PARAMETER" => {
                    let (key, raw) = value.split_once(char::is_whitespace).ok_or_else(|| {
                        fail("PARAMETER needs a name and a value, like `PARAMETER temperature 0.7`".to_owned())
                    })?;
                    let raw = unquote(raw.trim());
                    let kind = PARAMETERS
                        .iter()
                        .find(|(name, _)| *name == key)
                        .map(|(_, kind)| *kind)
                        .ok_or_else(|| fail(format!("unknown parameter \"{key}\"")))?;
                    let typed = typed(kind, raw).ok_or_else(|| fail(format!("{key} must be {kind}, not \"{raw}\"")))?;
                    if kind == Kind::Strings {
                        let list = out.parameters.entry(key.to_owned()).or_insert_with(|| Value::Array(Vec::new()));
                        if let Value::Array(items) = list {
                            items.push(typed);
                        }
                    } else {
                        out.parameters.insert(key.to_owned(), typed);
                    }
                }
                "TEMPLATE" => out.template = Some(value),
                "SYSTEM" => out.system = Some(value),
                "ADAPTER" => out.adapters.push(non_empty("ADAPTER", value).map_err(fail)?),
                "LICENSE" => out.licenses.push(value),
                "MESSAGE" => {
                    if !["system", "user", "assistant"].contains(&role) {
                        return Err(fail(format!("MESSAGE role must be system, user or assistant, not \"{role}\"")));
                    }
                    out.messages.push(Message { role: role.to_owned(), content: value });
                }
                other => return Err(fail(format!("unknown instruction \"{other}\""))),
            }
        }
        if from_line.is_none() {
            return Err(ModelfileError { line: lines.len().max(1), message: "no FROM instruction".to_owned() });
        }
        Ok(out)
    }

    /// The `params` layer's JSON: the parameters as an object.
    #[must_use]
    pub fn params_json(&self) -> Option<Vec<u8>> {
        (!self.parameters.is_empty()).then(|| serde_json::to_vec(&self.parameters).expect("a JSON map serializes"))
    }
}

/// An instruction's value: to the end of the line, or a `"""` block over several lines.
/// Returns the value and how many further lines it used.
fn value(rest: &str, following: &[&str]) -> Result<(String, usize), String> {
    let Some(after) = rest.strip_prefix("\"\"\"") else {
        return Ok((unquote(rest).to_owned(), 0));
    };
    if let Some(end) = after.find("\"\"\"") {
        return Ok((after[..end].to_owned(), 0));
    }
    let mut text = after.to_owned();
    for (used, line) in following.iter().enumerate() {
        text.push('\n');
        if let Some(end) = line.find("\"\"\"") {
            text.push_str(&line[..end]);
            return Ok((text.trim_start_matches('\n').to_owned(), used + 1));
        }
        text.push_str(line);
    }
    Err("a \"\"\" value is never closed".to_owned())
}

fn unquote(s: &str) -> &str {
    s.strip_prefix('"').and_then(|s| s.strip_suffix('"')).unwrap_or(s)
}

fn non_empty(instruction: &str, value: String) -> Result<String, String> {
    if value.trim().is_empty() { Err(format!("{instruction} needs a value")) } else { Ok(value) }
}

fn typed(kind: Kind, raw: &str) -> Option<Value> {
    match kind {
        Kind::Int => raw.parse::<i64>().ok().map(Value::from),
        Kind::Float => raw.parse::<f64>().ok().filter(|f| f.is_finite()).map(Value::from),
        Kind::Bool => raw.parse::<bool>().ok().map(Value::from),
        Kind::Strings => Some(Value::from(raw)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Message, Modelfile};

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
}
