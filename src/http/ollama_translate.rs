//! Ollama's request fields as llama-server's, and llama-server's tool calls back as
//! Ollama's: `format`, `think`, `tools`, chat messages (images, tool calls, tool
//! results, thinking) and a request's own `template`.
//!
//! Pure functions: the handlers in `ollama_generate` call them before leasing a runner,
//! so a bad field is refused before anything loads.

use std::collections::{BTreeMap, HashMap, VecDeque};

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::error::{self, ApiError, bad};
use crate::prompt_template::Renderer;

/// `format`: `"json"` (any JSON object) or a JSON schema, as the schema for
/// llama-server's `json_schema` on `/completion`. Absent, null or `""`: none.
///
/// Only `/completion` takes it: this llama-server's `/v1/chat/completions` wraps the
/// schema's grammar in the chat template's generation prompt and then fails to start the
/// sampler ("Failed to initialize samplers") for a `ChatML` model, so a constrained chat is
/// rendered with `/apply-template` and completed on `/completion` instead.
pub(super) fn format(request: &Map<String, Value>, path: &str) -> Result<Option<Value>, ApiError> {
    match request.get("format") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        // Ollama's JSON mode yields an object, not any JSON value.
        Some(Value::String(s)) if s == "json" => Ok(Some(json!({ "type": "object" }))),
        Some(Value::Object(schema)) => Ok(Some(Value::Object(schema.clone()))),
        Some(_) => Err(bad("invalid format: expected \"json\" or a JSON schema object", path)),
    }
}

/// `think`: `true`/`false`, or a level (`"high"`, `"medium"`, `"low"`), as the chat
/// template's `enable_thinking` (and `reasoning_effort`) in `chat_template_kwargs`.
pub(super) fn think(request: &Map<String, Value>, path: &str) -> Result<Map<String, Value>, ApiError> {
    let kwargs = match request.get("think") {
        None | Some(Value::Null) => return Ok(Map::new()),
        Some(Value::Bool(b)) => json!({ "enable_thinking": b }),
        Some(Value::String(level)) if matches!(level.as_str(), "high" | "medium" | "low") => {
            json!({ "enable_thinking": true, "reasoning_effort": level })
        }
        Some(_) => return Err(bad("invalid think: expected true, false, \"high\", \"medium\" or \"low\"", path)),
    };
    let mut fields = Map::new();
    fields.insert("chat_template_kwargs".into(), kwargs);
    Ok(fields)
}

/// `tools`: Ollama's are OpenAI's shape already (`{type: "function", function: {name,
/// description, parameters}}`); checked, with `type` filled in when left out.
pub(super) fn tools(request: &Map<String, Value>, path: &str) -> Result<Option<Value>, ApiError> {
    let invalid = || bad("invalid tools: expected a list of {type: \"function\", function: {name, ...}} objects", path);
    let items = match request.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) if items.is_empty() => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid()),
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Some(tool) = item.as_object() else { return Err(invalid()) };
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("function");
        let function = tool.get("function").and_then(Value::as_object).ok_or_else(invalid)?;
        let named = function.get("name").and_then(Value::as_str).is_some_and(|n| !n.is_empty());
        if kind != "function" || !named {
            return Err(invalid());
        }
        out.push(json!({ "type": "function", "function": function }));
    }
    Ok(Some(Value::Array(out)))
}

/// Chat messages in OpenAI's shape, and whether any carries an image.
///
/// `images` (base64) become content parts with data URLs; an assistant's `tool_calls`
/// get ids and string arguments; a `tool` message is tied to the call it answers (its
/// `tool_call_id`, else the oldest unanswered call of its `tool_name`, else the oldest
/// unanswered call); an assistant's `thinking` goes back as `reasoning_content`.
pub(super) fn messages(values: &[Value], path: &str) -> Result<(Vec<Value>, bool), ApiError> {
    let mut out = Vec::with_capacity(values.len());
    let mut any_images = false;
    let mut pending = Pending::default();
    let mut next_id = 0usize;
    for value in values {
        let shape = || bad("each message must be an object with a string role and content", path);
        let object = value.as_object().ok_or_else(shape)?;
        let role = object.get("role").and_then(Value::as_str).filter(|r| !r.is_empty()).ok_or_else(shape)?;
        let content = match object.get("content") {
            None | Some(Value::Null) => "",
            Some(Value::String(s)) => s.as_str(),
            Some(_) => return Err(shape()),
        };
        let mut message = Map::new();
        message.insert("role".into(), Value::String(role.to_owned()));
        let images = images(object.get("images"), path)?;
        if images.is_empty() {
            message.insert("content".into(), Value::String(content.to_owned()));
        } else {
            any_images = true;
            message.insert("content".into(), content_parts(content, &images));
        }
        if let Some(thinking) = object.get("thinking").and_then(Value::as_str).filter(|t| !t.is_empty()) {
            message.insert("reasoning_content".into(), Value::String(thinking.to_owned()));
        }
        match object.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                let mut translated = Vec::with_capacity(calls.len());
                for call in calls {
                    let (id, name, arguments) = tool_call(call, &mut next_id, path)?;
                    pending.push(&id, &name);
                    translated.push(
                        json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } }),
                    );
                }
                if !translated.is_empty() {
                    message.insert("tool_calls".into(), Value::Array(translated));
                }
            }
            Some(_) => return Err(bad("invalid tool_calls: expected a list", path)),
        }
        if role == "tool" {
            let given = object.get("tool_call_id").and_then(Value::as_str).filter(|s| !s.is_empty());
            let name = object.get("tool_name").and_then(Value::as_str).filter(|s| !s.is_empty());
            let id = if let Some(id) = given {
                pending.answer_id(id);
                Some(id.to_owned())
            } else {
                name.and_then(|n| pending.take_named(n)).or_else(|| pending.take_oldest())
            };
            if let Some(id) = id {
                message.insert("tool_call_id".into(), Value::String(id));
            }
            if let Some(name) = name {
                message.insert("name".into(), Value::String(name.to_owned()));
            }
        }
        out.push(Value::Object(message));
    }
    Ok((out, any_images))
}

/// The tool calls not answered yet, in the order they were made, found by id or by
/// function name in constant time: a request of `max_body` can carry hundreds of
/// thousands of calls and answers, and a scan of the list per answer took minutes.
#[derive(Default)]
struct Pending {
    /// (id, answered), oldest first; an answered call stays, marked, so indexes hold.
    calls: Vec<(String, bool)>,
    by_id: HashMap<String, Vec<usize>>,
    by_name: HashMap<String, VecDeque<usize>>,
    /// No call before this one is unanswered.
    oldest: usize,
}

impl Pending {
    fn push(&mut self, id: &str, name: &str) {
        let at = self.calls.len();
        self.calls.push((id.to_owned(), false));
        self.by_id.entry(id.to_owned()).or_default().push(at);
        self.by_name.entry(name.to_owned()).or_default().push_back(at);
    }

    /// Every unanswered call with this id is answered.
    fn answer_id(&mut self, id: &str) {
        for at in self.by_id.remove(id).unwrap_or_default() {
            self.calls[at].1 = true;
        }
    }

    /// The oldest unanswered call of this function, answered.
    fn take_named(&mut self, name: &str) -> Option<String> {
        let queue = self.by_name.get_mut(name)?;
        while let Some(at) = queue.pop_front() {
            if let Some(id) = take(&mut self.calls[at]) {
                return Some(id);
            }
        }
        None
    }

    /// The oldest unanswered call, answered.
    fn take_oldest(&mut self) -> Option<String> {
        while let Some(call) = self.calls.get_mut(self.oldest) {
            self.oldest += 1;
            if let Some(id) = take(call) {
                return Some(id);
            }
        }
        None
    }
}

/// A call's id if it was unanswered, now marked answered.
fn take((id, answered): &mut (String, bool)) -> Option<String> {
    (!std::mem::replace(answered, true)).then(|| id.clone())
}

/// One of an assistant's tool calls: its id (given, or made up), name, and arguments
/// as the JSON text OpenAI expects.
fn tool_call(call: &Value, next_id: &mut usize, path: &str) -> Result<(String, String, String), ApiError> {
    let invalid = || bad("invalid tool_calls: each needs a function with a name and arguments", path);
    let function = call.get("function").and_then(Value::as_object).ok_or_else(invalid)?;
    let name = function.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(invalid)?;
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(text)) => text.clone(),
        Some(value @ Value::Object(_)) => value.to_string(),
        Some(_) => return Err(invalid()),
    };
    let id = if let Some(id) = call.get("id").and_then(Value::as_str).filter(|s| !s.is_empty()) {
        id.to_owned()
    } else {
        *next_id += 1;
        format!("call_{next_id}")
    };
    Ok((id, name.to_owned(), arguments))
}

/// A message's (or generate's) `images`: base64 strings, checked and decoded just far
/// enough to name their type.
pub(super) fn images(value: Option<&Value>, path: &str) -> Result<Vec<(String, &'static str)>, ApiError> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad("invalid images: expected a list of base64 strings", path)),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let text = item.as_str().ok_or_else(|| bad("invalid images: expected a list of base64 strings", path))?;
            // Data URLs are accepted too: the part after the comma is the data.
            let data = text.split_once(";base64,").map_or(text, |(_, d)| d).trim();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(data)
                .map_err(|e| bad(format!("invalid image {i}: not base64 ({e})"), path))?;
            if bytes.is_empty() {
                return Err(bad(format!("invalid image {i}: empty"), path));
            }
            Ok((data.to_owned(), media_type(&bytes)))
        })
        .collect()
}

/// The media type of an image by its first bytes; llama-server decodes by content, so an
/// unknown kind is passed on as generic bytes.
fn media_type(bytes: &[u8]) -> &'static str {
    match bytes {
        [0x89, b'P', b'N', b'G', ..] => "image/png",
        [0xFF, 0xD8, 0xFF, ..] => "image/jpeg",
        [b'G', b'I', b'F', b'8', ..] => "image/gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "image/webp",
        [b'B', b'M', ..] => "image/bmp",
        _ => "application/octet-stream",
    }
}

/// Text and images as OpenAI's content parts.
pub(super) fn content_parts(text: &str, images: &[(String, &'static str)]) -> Value {
    let mut parts = Vec::with_capacity(images.len() + 1);
    for (data, kind) in images {
        parts.push(json!({ "type": "image_url", "image_url": { "url": format!("data:{kind};base64,{data}") } }));
    }
    if !text.is_empty() {
        parts.push(json!({ "type": "text", "text": text }));
    }
    Value::Array(parts)
}

/// The runner's streamed tool calls, put together by index (name and id arrive first,
/// the arguments' text in pieces).
#[derive(Debug, Default)]
pub(super) struct ToolCalls {
    calls: BTreeMap<u64, (String, String)>,
}

impl ToolCalls {
    /// Adds one delta's `tool_calls` (or a whole message's).
    pub(super) fn add(&mut self, calls: &Value) {
        let Some(calls) = calls.as_array() else { return };
        for (position, call) in calls.iter().enumerate() {
            let index = call["index"].as_u64().unwrap_or(position as u64);
            let entry = self.calls.entry(index).or_default();
            if let Some(name) = call["function"]["name"].as_str() {
                entry.0.push_str(name);
            }
            match &call["function"]["arguments"] {
                Value::String(piece) => entry.1.push_str(piece),
                Value::Object(_) => entry.1.push_str(&call["function"]["arguments"].to_string()),
                _ => {}
            }
        }
    }

    /// Whether none came.
    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Ollama's `tool_calls`: arguments as a JSON object (OpenAI sends them as text).
    /// Text that is not a JSON object is kept whole under `arguments` as a string, so
    /// nothing the model said is lost.
    pub(super) fn take(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.calls)
            .into_values()
            .enumerate()
            .map(|(index, (name, arguments))| {
                let arguments =
                    match serde_json::from_str::<Value>(if arguments.trim().is_empty() { "{}" } else { &arguments }) {
                        Ok(object @ Value::Object(_)) => object,
                        _ => Value::String(arguments),
                    };
                json!({ "function": { "index": index, "name": name, "arguments": arguments } })
            })
            .collect()
    }
}

/// Renders a request's `template` (Go template syntax, as Ollama's: `{{ .System }}`,
/// `{{ .Prompt }}`, `{{ .Response }}`, `if`/`range`, trim markers) off the async workers,
/// within [`crate::prompt_template`]'s limits. Every refusal is the request's fault (400) and
/// names the limit, except too many renders at once (503, retry) and a render thread
/// that could not start (500).
pub(super) async fn render_template(
    renderer: &Renderer,
    template: &str,
    system: &str,
    prompt: &str,
    suffix: &str,
    path: &str,
) -> Result<String, ApiError> {
    let fields = [("System", system), ("Prompt", prompt), ("Suffix", suffix), ("Response", "")];
    renderer.render(template, &fields).await.map_err(|e| error::template(&e, path))
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value, json};

    use super::{ToolCalls, format, images, messages, think, tools};

    fn map(value: Value) -> Map<String, Value> {
        serde_json::from_value(value).expect("an object")
    }

    fn message_of(error: &super::ApiError) -> String {
        format!("{error:?}")
    }

    #[test]
    fn format_json_and_schemas_become_a_json_schema() {
        let schema = json!({ "type": "object", "properties": { "a": { "type": "boolean" } } });
        assert_eq!(
            format(&map(json!({ "format": "json" })), "/api/chat").expect("json"),
            Some(json!({ "type": "object" }))
        );
        assert_eq!(format(&map(json!({ "format": schema })), "/api/chat").expect("schema"), Some(schema));
        for absent in [json!({}), json!({ "format": null }), json!({ "format": "" })] {
            assert_eq!(format(&map(absent), "/api/chat").expect("none"), None);
        }
        for wrong in [json!(3), json!("xml"), json!(["json"]), json!(true)] {
            let error = format(&map(json!({ "format": wrong })), "/api/chat").expect_err("wrong");
            assert!(message_of(&error).contains("invalid format"), "{wrong}");
        }
    }

    #[test]
    fn think_maps_to_the_chat_templates_switch() {
        let on = think(&map(json!({ "think": true })), "/api/chat").expect("bool");
        assert_eq!(Value::Object(on), json!({ "chat_template_kwargs": { "enable_thinking": true } }));
        let off = think(&map(json!({ "think": false })), "/api/chat").expect("bool");
        assert_eq!(Value::Object(off), json!({ "chat_template_kwargs": { "enable_thinking": false } }));
        let high = think(&map(json!({ "think": "high" })), "/api/chat").expect("level");
        assert_eq!(
            Value::Object(high),
            json!({ "chat_template_kwargs": { "enable_thinking": true, "reasoning_effort": "high" } })
        );
        assert!(think(&map(json!({})), "/api/chat").expect("none").is_empty());
        for wrong in [json!(1), json!("max"), json!({})] {
            let error = think(&map(json!({ "think": wrong })), "/api/chat").expect_err("wrong");
            assert!(message_of(&error).contains("invalid think"), "{wrong}");
        }
    }

    #[test]
    fn tools_are_checked_and_typed() {
        let request = map(json!({ "tools": [{ "function": { "name": "f", "parameters": { "type": "object" } } }] }));
        assert_eq!(
            tools(&request, "/api/chat").expect("tools"),
            Some(json!([{ "type": "function", "function": { "name": "f", "parameters": { "type": "object" } } }]))
        );
        assert_eq!(tools(&map(json!({ "tools": [] })), "/api/chat").expect("none"), None);
        for wrong in
            [json!("f"), json!([1]), json!([{ "function": {} }]), json!([{ "type": "x", "function": { "name": "f" } }])]
        {
            let error = tools(&map(json!({ "tools": wrong })), "/api/chat").expect_err("wrong");
            assert!(message_of(&error).contains("invalid tools"), "{wrong}");
        }
    }

    #[test]
    fn tool_calls_and_results_translate_with_ids() {
        let (out, any_images) = messages(
            json!([
                { "role": "user", "content": "weather?" },
                { "role": "assistant", "content": "", "thinking": "hmm", "tool_calls": [
                    { "function": { "name": "weather", "arguments": { "city": "Oslo" } } },
                    { "function": { "name": "time", "arguments": {} } }
                ] },
                { "role": "tool", "content": "12:00", "tool_name": "time" },
                { "role": "tool", "content": "rain" }
            ])
            .as_array()
            .expect("list"),
            "/api/chat",
        )
        .expect("valid");
        assert!(!any_images);
        assert_eq!(out[1]["reasoning_content"], "hmm");
        assert_eq!(
            out[1]["tool_calls"],
            json!([
                { "id": "call_1", "type": "function", "function": { "name": "weather", "arguments": "{\"city\":\"Oslo\"}" } },
                { "id": "call_2", "type": "function", "function": { "name": "time", "arguments": "{}" } }
            ])
        );
        assert_eq!(out[2], json!({ "role": "tool", "content": "12:00", "tool_call_id": "call_2", "name": "time" }));
        assert_eq!(out[3], json!({ "role": "tool", "content": "rain", "tool_call_id": "call_1" }));
        let error = messages(&[json!({ "role": "assistant", "tool_calls": [{ "function": {} }] })], "/api/chat")
            .expect_err("no name");
        assert!(message_of(&error).contains("invalid tool_calls"));
    }

    /// A conversation of tool calls and answers: per message, either an assistant's calls
    /// (each with a name from a few, and an id given or not) or a tool's answer (by id, by
    /// name, or neither).
    fn conversation() -> impl proptest::strategy::Strategy<Value = Vec<Value>> {
        use proptest::prelude::*;
        let id = prop_oneof![Just(None), (0..4u8).prop_map(|i| Some(format!("id{i}")))];
        let name = (0..3u8).prop_map(|i| format!("f{i}"));
        let call = (id.clone(), name.clone()).prop_map(|(id, name)| match id {
            Some(id) => json!({ "id": id, "function": { "name": name } }),
            None => json!({ "function": { "name": name } }),
        });
        let calls = proptest::collection::vec(call, 0..4)
            .prop_map(|calls| json!({ "role": "assistant", "content": "", "tool_calls": calls }));
        let answer = (id, proptest::option::of(name)).prop_map(|(id, name)| {
            let mut answer = json!({ "role": "tool", "content": "x" });
            if let Some(id) = id {
                answer["tool_call_id"] = json!(id);
            }
            if let Some(name) = name {
                answer["tool_name"] = json!(name);
            }
            answer
        });
        proptest::collection::vec(prop_oneof![calls, answer], 0..24)
    }

    /// What each answer is tied to, by the rule as written: one list of the calls not
    /// answered yet, searched from the oldest.
    fn tied_by_a_plain_list(values: &[Value]) -> Vec<Option<String>> {
        let mut pending: Vec<(String, String)> = Vec::new();
        let mut next_id = 0;
        let mut tied = Vec::new();
        for value in values {
            for call in value["tool_calls"].as_array().into_iter().flatten() {
                let name = call["function"]["name"].as_str().expect("named").to_owned();
                let id = call["id"].as_str().map_or_else(
                    || {
                        next_id += 1;
                        format!("call_{next_id}")
                    },
                    str::to_owned,
                );
                pending.push((id, name));
            }
            if value["role"] == "tool" {
                tied.push(if let Some(id) = value["tool_call_id"].as_str() {
                    pending.retain(|(p, _)| p != id);
                    Some(id.to_owned())
                } else {
                    let named = value["tool_name"].as_str().and_then(|n| pending.iter().position(|(_, p)| p == n));
                    named.or((!pending.is_empty()).then_some(0)).map(|at| pending.remove(at).0)
                });
            }
        }
        tied
    }

    proptest::proptest! {
        /// Answers are tied to calls as the plain list ties them: by id, else the oldest
        /// unanswered call of the name, else the oldest unanswered call.
        #[test]
        fn answers_are_tied_to_calls_as_a_plain_list_ties_them(values in conversation()) {
            let (out, _) = messages(&values, "/api/chat").expect("valid");
            let tied: Vec<Option<String>> = out
                .iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| m["tool_call_id"].as_str().map(str::to_owned))
                .collect();
            proptest::prop_assert_eq!(tied, tied_by_a_plain_list(&values));
        }
    }

    /// A request of many calls and many answers tied to none of them is translated at
    /// once (each answer used to scan every call left: 40 000 of each took 1.6 s in a
    /// release build, a `max_body` request minutes); the answers keep their ids and the
    /// calls stay open for the answers after them.
    #[test]
    fn many_calls_and_answers_are_tied_without_a_scan_per_answer() {
        const N: usize = 100_000;
        let calls: Vec<Value> = (0..N).map(|_| json!({ "function": { "name": "f" } })).collect();
        let mut values = vec![json!({ "role": "assistant", "content": "", "tool_calls": calls })];
        values.extend((0..N).map(|_| json!({ "role": "tool", "content": "", "tool_call_id": "elsewhere" })));
        values.push(json!({ "role": "tool", "content": "", "tool_name": "f" }));
        values.push(json!({ "role": "tool", "content": "" }));
        let (out, _) = messages(&values, "/api/chat").expect("valid");
        assert_eq!(out.len(), N + 3);
        assert!(out[1..=N].iter().all(|m| m["tool_call_id"] == "elsewhere"));
        assert_eq!(out[N + 1]["tool_call_id"], "call_1");
        assert_eq!(out[N + 2]["tool_call_id"], "call_2");
    }

    #[test]
    fn images_become_data_url_parts_and_bad_base64_is_refused() {
        let png = "iVBORw0KGgo="; // the PNG signature
        let (out, any_images) =
            messages(&[json!({ "role": "user", "content": "what is it?", "images": [png] })], "/api/chat").expect("ok");
        assert!(any_images);
        assert_eq!(
            out[0]["content"],
            json!([
                { "type": "image_url", "image_url": { "url": format!("data:image/png;base64,{png}") } },
                { "type": "text", "text": "what is it?" }
            ])
        );
        let error = images(Some(&json!(["not base64!"])), "/api/chat").expect_err("bad");
        assert!(message_of(&error).contains("invalid image 0: not base64"));
        let error = images(Some(&json!("x")), "/api/chat").expect_err("not a list");
        assert!(message_of(&error).contains("invalid images"));
    }

    #[test]
    fn streamed_tool_calls_join_and_arguments_become_objects() {
        let mut calls = ToolCalls::default();
        calls.add(&json!([{ "index": 0, "id": "a", "function": { "name": "weather", "arguments": "{\"ci" } }]));
        calls.add(&json!([{ "index": 0, "function": { "arguments": "ty\":\"Oslo\"}" } }]));
        calls.add(&json!([{ "index": 1, "function": { "name": "noop", "arguments": "" } }]));
        assert!(!calls.is_empty());
        assert_eq!(
            calls.take(),
            [
                json!({ "function": { "index": 0, "name": "weather", "arguments": { "city": "Oslo" } } }),
                json!({ "function": { "index": 1, "name": "noop", "arguments": {} } })
            ]
        );
        assert!(calls.is_empty());
    }

    #[tokio::test]
    async fn templates_render_ollamas_fields_and_bad_ones_are_named() {
        let renderer = crate::prompt_template::Renderer::default();
        let render_template = |template: &str, system: &str, prompt: &str, path: &str| {
            let (template, system, prompt, path) =
                (template.to_owned(), system.to_owned(), prompt.to_owned(), path.to_owned());
            let renderer = renderer.clone();
            async move { super::render_template(&renderer, &template, &system, &prompt, "", &path).await }
        };
        let template = "{{ if .System }}<sys>{{ .System }}</sys>{{ end }}<user>{{ .Prompt }}</user>{{ .Response }}";
        assert_eq!(
            render_template(template, "be brief", "hi", "/api/generate").await.expect("renders"),
            "<sys>be brief</sys><user>hi</user>"
        );
        assert_eq!(render_template(template, "", "hi", "/api/generate").await.expect("renders"), "<user>hi</user>");
        let trimmed = "{{- if .System }} {{ .System }} {{- end }}|{{ .Prompt -}} ";
        assert_eq!(render_template(trimmed, "s", "p", "/api/generate").await.expect("renders"), " s|p");
        let error = render_template("{{ if .System }}unclosed", "", "p", "/api/generate").await.expect_err("bad");
        assert!(message_of(&error).contains("invalid template"));
        let deep = format!("{}x{}", "{{ if 1 }}".repeat(100), "{{ end }}".repeat(100));
        let error = render_template(&deep, "", "p", "/api/generate").await.expect_err("deep");
        assert!(message_of(&error).contains("status: 400"), "{error:?}");
        assert!(message_of(&error).contains("template nests deeper than 64 levels"), "{error:?}");

        // A fill-in-the-middle template, as Ollama's code models carry: the suffix as `.Suffix`.
        let fim = "{{ if .Suffix }}<PRE>{{ .Prompt }}<SUF>{{ .Suffix }}<MID>{{ else }}{{ .Prompt }}{{ end }}";
        let filled = super::render_template(&renderer, fim, "", "def f(", "):", "/api/generate").await;
        assert_eq!(filled.expect("renders"), "<PRE>def f(<SUF>):<MID>");
    }
}
