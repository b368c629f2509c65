//! Hostile request templates (`template` in `/api/generate`), through the real HTTP
//! stack: each is refused with a 400 naming the limit it broke, whatever the model
//! name, and the daemon answers a normal request afterwards.
//!
//! Before `prompt_template`, the deep and recursive ones overflowed a tokio worker's
//! stack and aborted the whole process (here: the test binary, or the corrald child),
//! a huge `printf` width panicked the handler, and nested ranges rendered tens of MiB.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::support::api::{call, state};
use crate::support::corrald::Corrald;
use crate::support::http;

/// Hostile templates: what each does, the template, and what the refusal must say.
fn hostile() -> Vec<(&'static str, String, &'static str)> {
    let nest = |open: &str, inner: &str, close: &str, n: usize| format!("{}{inner}{}", open.repeat(n), close.repeat(n));
    let mut doubling = String::from(r#"{{ $a := "0123456789abcdef" }}"#);
    for _ in 0..24 {
        doubling.push_str("{{ $a := print $a $a }}");
    }
    let mut calls = String::from(r#"{{ define "t0" }}x{{ end }}"#);
    for i in 1..=40 {
        let _ = write!(
            calls,
            r#"{{{{ define "t{i}" }}}}{{{{ template "t{}" }}}}{{{{ template "t{}" }}}}{{{{ end }}}}"#,
            i - 1,
            i - 1
        );
    }
    calls.push_str(r#"{{ template "t40" }}"#);
    let deeper = "template nests deeper than 64 levels";
    vec![
        ("nested ifs", nest("{{ if 1 }}", "x", "{{ end }}", 2000), deeper),
        ("nested ranges", nest("{{ range $ }}", "x", "{{ end }}", 1500), deeper),
        ("nested parentheses", format!("{{{{ {}1{} }}}}", "(print ".repeat(5000), ")".repeat(5000)), deeper),
        ("an else-if chain", format!("{{{{ if 0 }}}}{}{{{{ end }}}}", "{{ else if 0 }}".repeat(3000)), deeper),
        ("unclosed blocks", "{{ with . }}".repeat(5000), deeper),
        (
            "self recursion",
            r#"{{ define "r" }}{{ template "r" . }}{{ end }}{{ template "r" . }}"#.into(),
            "template \"r\" calls itself, directly or through other templates",
        ),
        (
            "mutual recursion",
            r#"{{ define "a" }}a{{ template "b" . }}{{ end }}{{ define "b" }}b{{ template "a" . }}{{ end }}{{ template "a" . }}"#.into(),
            "calls itself, directly or through other templates",
        ),
        ("ranges over ranges", nest("{{ range $ }}", "x", "{{ end }}", 16), "template would take more than 100000 steps"),
        ("calls that double", calls, "template would take more than 100000 steps"),
        // Five ranges over the four fields (System, Prompt, Suffix, Response): 24 MiB.
        ("output explosion", nest("{{ range $ }}", &"x".repeat(24 << 10), "{{ end }}", 5), "template output is larger than 16 MiB"),
        ("a printf width", r#"{{ printf "%99999999d" 1 }}"#.into(), "template builds a string larger than 16 KiB"),
        ("strings that double", doubling, "template builds a string larger than 16 KiB"),
        ("a huge template", "x".repeat((64 << 10) + 1), "template is larger than 64 KiB"),
        (
            "nesting behind an escaped name",
            format!(r#"{{{{ define "a" }}}}x{{{{ end }}}}{{{{ template "\x61" }}}}{}"#, nest("{{ if 1 }}", "x", "{{ end }}", 2000)),
            "template names with escapes are not supported",
        ),
    ]
}

fn generate(model: &str, template: &str) -> String {
    json!({ "model": model, "prompt": "once upon", "stream": false, "template": template, "options": { "num_predict": 2 } })
        .to_string()
}

/// A normal templated request: the prompt rendered and generated from.
const NORMAL: &str = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_request_templates_get_a_400_naming_the_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    for (what, template, message) in hostile() {
        // The template is checked before the model is looked up: any name will do.
        for model in ["chat", "no-such-model"] {
            let (status, _, body) = call(&state, "POST", "/api/generate", &generate(model, &template)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{what} ({model}): {body}");
            let error: Value = serde_json::from_str(&body).expect("JSON");
            let error = error["error"].as_str().unwrap_or_default();
            assert!(error.contains(message), "{what}: {error:?} does not say {message:?}");
        }
    }
    let (status, _, body) = call(&state, "POST", "/api/generate", &generate("chat", NORMAL)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let reply: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(reply["done"], true, "{reply}");
    assert_eq!(reply["eval_count"], 2, "{reply}");
}

#[test]
fn corrald_survives_hostile_templates_and_answers_afterwards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (corrald, port, _notify) = crate::support::corrald::on_demo_store(dir.path());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
    let send = |body: &str| {
        let stream = http::connect(&addr.to_string(), || std::net::TcpStream::connect(addr));
        stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
        http::request(stream, "POST", "/api/generate", Some(body))
    };
    for (what, template, message) in hostile() {
        let reply = send(&generate("chat", &template));
        assert_eq!(reply.status, 400, "{what}: {}", reply.body);
        assert!(reply.json()["error"].as_str().is_some_and(|e| e.contains(message)), "{what}: {}", reply.body);
        assert!(alive(&corrald), "corrald died on {what}:\n{}", corrald.stderr());
    }
    let reply = send(&generate("chat", NORMAL));
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["done"], true, "{}", reply.body);
    assert!(alive(&corrald), "{}", corrald.stderr());
}

/// Whether the process still runs (exists and is no zombie).
fn alive(corrald: &Corrald) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", corrald.pid()))
        .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_nested_past_serde_jsons_limit_is_a_400_in_every_field() {
    // serde_json stops at 128 levels (its `unbounded_depth` feature is off), so no field
    // of a body (format, tools, messages, options) reaches a recursive walk unbounded.
    let dir = tempfile::tempdir().expect("tempdir");
    let state = state(dir.path());
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    for (path, field) in [
        ("/api/generate", "format"),
        ("/api/generate", "options"),
        ("/api/chat", "messages"),
        ("/api/chat", "tools"),
        ("/api/chat", "format"),
    ] {
        let body = format!(r#"{{"model":"chat","prompt":"x","{field}":{deep}}}"#);
        let (status, _, reply) = call(&state, "POST", path, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {field}: {reply}");
        assert!(reply.contains("recursion limit exceeded"), "{path} {field}: {reply}");
    }
    // 100 levels, within the limit, are parsed and refused for their shape, not crashed on.
    let nested = format!("{}1{}", "{\"a\":".repeat(100), "}".repeat(100));
    let body = format!(r#"{{"model":"chat","messages":[{{"role":"user","content":{nested}}}]}}"#);
    let (status, _, reply) = call(&state, "POST", "/api/chat", &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
}
