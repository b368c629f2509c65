//! Feeds arbitrary text to the Modelfile parser (what `ollama create` and `corralctl
//! create` read).  A Modelfile that parses has a `FROM`, known parameters of the right
//! types and known roles; an error names a line of the input.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use corral::store::modelfile::{Modelfile, parameter_names};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = common::text(data);
    match Modelfile::parse(&text) {
        Ok(m) => {
            assert!(!m.from.trim().is_empty(), "FROM without a value: {text:?}");
            assert!(m.adapters.iter().all(|a| !a.trim().is_empty()));
            assert!(m.messages.iter().all(|msg| ["system", "user", "assistant"].contains(&msg.role.as_str())));
            let names: Vec<&str> = parameter_names().collect();
            assert!(m.parameters.keys().all(|k| names.contains(&k.as_str())), "{:?}", m.parameters);
            if let Some(json) = m.params_json() {
                let back: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&json).expect("params JSON parses back");
                assert_eq!(back.len(), m.parameters.len());
            }
            // Parsing is a function of the text.
            assert_eq!(Modelfile::parse(&text).as_ref(), Ok(&m));
        }
        Err(e) => {
            let lines = text.lines().count().max(1);
            assert!((1..=lines).contains(&e.line), "line {} of {lines}: {e}", e.line);
            assert!(e.to_string().starts_with("Modelfile line "));
        }
    }
});
