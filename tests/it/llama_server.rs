//! The tiny models of `corral::demo_model` load and run in the real upstream `llama-server`.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::support::llama::LlamaServer;

/// Writes a model with `write` into a fresh temporary directory.
fn model(name: &str, write: fn(&std::path::Path) -> std::io::Result<()>) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    write(&path).expect("write the model");
    (dir, path)
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or_else(|| panic!("not a string: {value}"))
}

#[test]
fn tiny_llama_generates_exactly_n_predict_tokens() {
    let (_dir, path) = model("tiny-llama.gguf", corral::demo_model::write_tiny_llama);
    let mut server = LlamaServer::start(&path, &[]);

    let models = server.get_json("/v1/models");
    let meta = &models["data"][0]["meta"];
    assert_eq!(meta["n_embd"], 64, "{models}");
    assert_eq!(meta["n_ctx_train"], 2048, "{models}");

    // Several seeds: the generation must never stop early and never emit broken UTF-8.
    for seed in 1..=4 {
        let r = server.post_json("/completion", &json!({"prompt": "hello world", "n_predict": 16, "seed": seed}));
        assert_eq!(r["tokens_predicted"], 16, "seed {seed}: {r}");
        assert_eq!(r["stop_type"], "limit", "seed {seed}: {r}");
        let content = text(&r["content"]);
        assert!(!content.trim().is_empty() && content.is_ascii(), "seed {seed}: {content:?}");
    }

    // The tokenizer: whole words are single tokens, a newline is the byte token.
    let tokens = server.post_json("/tokenize", &json!({"content": "hello world\n", "with_pieces": true}));
    let pieces: Vec<&str> = tokens["tokens"].as_array().expect("tokens").iter().map(|t| text(&t["piece"])).collect();
    assert_eq!(pieces, [" hello", " world", "\n"], "{tokens}");

    // SIGTERM when idle: a clean exit.
    let status = server.stop();
    assert!(status.success(), "{status}; stderr:\n{}", server.stderr());
    assert!(server.stderr().contains("cleaning up before exit"), "{}", server.stderr());
}

#[test]
fn tiny_llama_chats_in_chatml_and_honours_max_tokens() {
    let (_dir, path) = model("tiny-llama.gguf", corral::demo_model::write_tiny_llama);
    let server = LlamaServer::start(&path, &[]);
    let messages = json!([
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "hello"},
    ]);

    let prompt = server.post_json("/apply-template", &json!({"messages": messages}));
    assert_eq!(
        text(&prompt["prompt"]),
        "<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );

    let r = server.post_json("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 8, "seed": 7}));
    assert_eq!(r["object"], "chat.completion", "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{r}");
    assert_eq!(choice["message"]["role"], "assistant", "{r}");
    assert!(!text(&choice["message"]["content"]).trim().is_empty(), "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 8, "{r}");
}

#[test]
fn tiny_bert_serves_64_dimensional_embeddings() {
    let (_dir, path) = model("tiny-bert.gguf", corral::demo_model::write_tiny_bert);
    let server = LlamaServer::start(&path, &["--embeddings"]);

    let r = server.post_json("/v1/embeddings", &json!({"input": ["hello world", "the answer", "hello world"]}));
    let data = r["data"].as_array().expect("data");
    assert_eq!(data.len(), 3, "{r}");
    let vectors: Vec<Vec<f64>> = data
        .iter()
        .map(|d| d["embedding"].as_array().expect("embedding").iter().map(|x| x.as_f64().expect("number")).collect())
        .collect();
    for v in &vectors {
        assert_eq!(v.len(), 64);
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "the server normalises embeddings: norm {norm}");
    }
    assert_ne!(vectors[0], vectors[1], "different texts, different embeddings");
    let same = vectors[0].iter().zip(&vectors[2]).all(|(a, b)| (a - b).abs() < 1e-5);
    assert!(same, "the same text twice gives the same embedding");
    assert!(r["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n >= 6), "{r}");
}
