//! Feeds arbitrary bytes as the JSON body of every API request that carries one: chat,
//! generate (translated into llama-server's request as the handlers do), embed, create,
//! pull/push, show, copy, delete, and the sampling options.  A body is either accepted or
//! refused with 400: never a 5xx, never a panic.

#![no_main]

use corral::http::parsers;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn check(what: &str, result: Result<Value, parsers::ApiError>, data: &[u8]) {
    match result {
        Ok(value) => {
            let _ = serde_json::to_vec(&value).expect("the translation serializes");
        }
        Err(e) => {
            let status = parsers::status(e);
            assert_eq!(status, 400, "{what}: {status} for {:?}", String::from_utf8_lossy(data));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check("chat", parsers::chat(data), data);
    check("generate", parsers::generate(data), data);
    check("embed", parsers::embed(data), data);
    check("create", parsers::create(data), data);
    check("pull", parsers::transfer(data), data);
    for result in parsers::model_bodies(data) {
        check("show/copy/delete", result, data);
    }
    if let Ok(Value::Object(options)) = serde_json::from_slice::<Value>(data) {
        check("options", parsers::options(&options), data);
    }
});
