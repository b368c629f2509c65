//! D-Bus `a{sv}` options: the adapter that brings their values to the request parser's
//! [`OptionValue`], so that the load options and the keep-alive are read by the same code,
//! with the same rules and messages, as the HTTP API's JSON.

use std::collections::HashMap;

use zbus::zvariant::{OwnedValue, Value};

use super::error::Error;
use crate::scheduler::keep_alive::KeepAlive;
use crate::scheduler::request::{self, LOAD_OPTIONS, LoadOverrides, OptionSource, OptionValue};

/// A Load call's options, through the request parser.
pub(super) struct Options<'a>(pub(super) &'a HashMap<String, OwnedValue>);

/// The `a{sv}` adapter: integers of every width, doubles, strings and booleans as
/// themselves (a variant inside the variant, as some clients send, unwrapped); anything
/// else by its signature, which the parser refuses where it expects a value.
impl OptionSource for Options<'_> {
    fn option(&self, key: &str) -> Option<OptionValue> {
        self.0.get(key).map(|v| option_value(v))
    }
}

fn option_value(value: &Value<'_>) -> OptionValue {
    match value {
        Value::Bool(b) => OptionValue::Bool(*b),
        Value::U8(n) => OptionValue::Integer((*n).into()),
        Value::I16(n) => OptionValue::Integer((*n).into()),
        Value::U16(n) => OptionValue::Integer((*n).into()),
        Value::I32(n) => OptionValue::Integer((*n).into()),
        Value::U32(n) => OptionValue::Integer((*n).into()),
        Value::I64(n) => OptionValue::Integer((*n).into()),
        Value::U64(n) => OptionValue::Integer((*n).into()),
        Value::F64(n) => OptionValue::Float(*n),
        Value::Str(s) => OptionValue::Text(s.to_string()),
        Value::Value(inner) => option_value(inner),
        other => OptionValue::Other(other.value_signature().to_string()),
    }
}

/// Load options (`num_ctx`, `num_gpu`, …) and the keep-alive from a Load call's options;
/// any other key is refused, naming the known ones.
pub(super) fn load_options(options: &HashMap<String, OwnedValue>) -> Result<(LoadOverrides, Option<KeepAlive>), Error> {
    let mut known: Vec<&str> = LOAD_OPTIONS.to_vec();
    known.push("keep_alive");
    only(options, &known)?;
    let source = Options(options);
    let load = LoadOverrides::parse(&source)?;
    let keep_alive = request::keep_alive(&source, "keep_alive")?;
    Ok((load, keep_alive))
}

/// A boolean option, false when absent.
pub(super) fn flag(options: &HashMap<String, OwnedValue>, key: &str) -> Result<bool, Error> {
    match options.get(key).map(|v| &**v) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => {
            Err(Error::InvalidArgument(format!("option {key} must be a boolean (b), not {}", other.value_signature())))
        }
    }
}

/// Rejects keys other than `allowed`, naming them.
pub(super) fn only(options: &HashMap<String, OwnedValue>, allowed: &[&str]) -> Result<(), Error> {
    let mut unknown: Vec<&str> = options.keys().map(String::as_str).filter(|k| !allowed.contains(k)).collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    Err(Error::InvalidArgument(format!("unknown option {}; known: {}", unknown.join(", "), allowed.join(", "))))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use serde_json::{Map, Value as Json, json};
    use zbus::zvariant::{OwnedValue, Value};

    use super::{Options, flag, load_options, only};
    use crate::dbus::error::Error;
    use crate::scheduler::keep_alive::KeepAlive;
    use crate::scheduler::request::{self, GpuLayers, LoadOverrides};

    fn options(pairs: &[(&str, Value<'_>)]) -> HashMap<String, OwnedValue> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), v.try_to_owned().expect("owned"))).collect()
    }

    fn message(error: Error) -> String {
        match error {
            Error::InvalidArgument(m) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// What the HTTP API makes of a JSON body with these options and keep-alive: the
    /// same parser through the JSON adapter, its error as the message a client gets.
    fn over_json(body: &Json) -> Result<(LoadOverrides, Option<KeepAlive>), String> {
        let body: Map<String, Json> = body.as_object().cloned().expect("object");
        let load = LoadOverrides::parse(&body).map_err(|e| e.to_string())?;
        let keep_alive = request::keep_alive(&body, "keep_alive").map_err(|e| e.to_string())?;
        Ok((load, keep_alive))
    }

    /// The same through the `a{sv}` adapter.
    fn over_dbus(given: &HashMap<String, OwnedValue>) -> Result<(LoadOverrides, Option<KeepAlive>), String> {
        let source = Options(given);
        let load = LoadOverrides::parse(&source).map_err(|e| e.to_string())?;
        let keep_alive = request::keep_alive(&source, "keep_alive").map_err(|e| e.to_string())?;
        Ok((load, keep_alive))
    }

    #[test]
    fn both_adapters_give_the_same_options_and_the_same_errors() {
        let cases: Vec<(Json, Vec<(&str, Value<'_>)>)> = vec![
            (
                json!({"num_ctx": 4096, "num_gpu": -1, "use_mmap": false, "keep_alive": "10m"}),
                vec![
                    ("num_ctx", Value::U32(4096)),
                    ("num_gpu", Value::I32(-1)),
                    ("use_mmap", Value::Bool(false)),
                    ("keep_alive", Value::from("10m")),
                ],
            ),
            (
                json!({"num_batch": 512, "num_thread": 8, "main_gpu": 1, "num_gpu": 20, "keep_alive": -1}),
                vec![
                    ("num_batch", Value::U64(512)),
                    ("num_thread", Value::I64(8)),
                    ("main_gpu", Value::U8(1)),
                    ("num_gpu", Value::I16(20)),
                    ("keep_alive", Value::I64(-1)),
                ],
            ),
            (json!({"keep_alive": 1.5}), vec![("keep_alive", Value::F64(1.5))]),
            (json!({}), vec![]),
            // The errors: each names the key and the problem, in the same words.
            (json!({"num_ctx": "big"}), vec![("num_ctx", Value::from("big"))]),
            (json!({"num_ctx": -5}), vec![("num_ctx", Value::I32(-5))]),
            (json!({"num_ctx": 4096.0}), vec![("num_ctx", Value::F64(4096.0))]),
            (json!({"num_ctx": [1, 2]}), vec![("num_ctx", Value::from(vec![1_u32, 2]))]),
            (json!({"num_batch": 1_u64 << 40}), vec![("num_batch", Value::U64(1 << 40))]),
            (json!({"num_gpu": "all"}), vec![("num_gpu", Value::from("all"))]),
            (json!({"num_gpu": 1.5}), vec![("num_gpu", Value::F64(1.5))]),
            (json!({"use_mmap": 1}), vec![("use_mmap", Value::U32(1))]),
            (json!({"use_mmap": "yes"}), vec![("use_mmap", Value::from("yes"))]),
            (json!({"keep_alive": "soon"}), vec![("keep_alive", Value::from("soon"))]),
            (json!({"keep_alive": true}), vec![("keep_alive", Value::Bool(true))]),
        ];
        for (body, pairs) in cases {
            let http = over_json(&body);
            let given = options(&pairs);
            assert_eq!(http, over_dbus(&given), "{body}");
            // A Load call gets the parser's result, its message the parser's (the keep-alive,
            // one option among others here, named as one).
            let call = load_options(&given).map_err(message);
            let expected =
                http.map_err(|e| if e.contains("keep_alive") { format!("option keep_alive: {e}") } else { e });
            assert_eq!(call, expected, "{body}");
        }
        let (load, keep_alive) = over_json(&json!({"num_ctx": 4096, "num_gpu": -1, "keep_alive": "10m"})).expect("ok");
        assert_eq!((load.num_ctx, load.num_gpu), (Some(4096), Some(GpuLayers::Auto)));
        assert_eq!(keep_alive, Some(KeepAlive::For(Duration::from_secs(600))));
        let err = message(load_options(&options(&[("num_ctx", Value::from("big"))])).expect_err("bad"));
        assert_eq!(err, "invalid option num_ctx: expected a non-negative integer");
        let err = message(load_options(&options(&[("use_mmap", Value::U32(1))])).expect_err("bad"));
        assert_eq!(err, "invalid option use_mmap: expected true or false");
        let err = message(load_options(&options(&[("keep_alive", Value::from("soon"))])).expect_err("bad"));
        assert!(err.starts_with("option keep_alive: invalid keep_alive \"soon\": "), "{err}");
    }

    #[test]
    fn a_variant_in_a_variant_is_its_value_and_absent_keep_alive_is_none() {
        let nested = options(&[("num_ctx", Value::Value(Box::new(Value::U32(2048))))]);
        let (load, keep_alive) = load_options(&nested).expect("valid");
        assert_eq!((load.num_ctx, keep_alive), (Some(2048), None));
        let (load, none) = load_options(&HashMap::new()).expect("valid");
        assert_eq!((load, none), (LoadOverrides::default(), None));
    }

    #[test]
    fn unknown_load_options_and_wrong_flags_are_named() {
        let err = message(load_options(&options(&[("temperature", Value::F64(0.5))])).expect_err("unknown"));
        assert_eq!(
            err,
            "unknown option temperature; known: num_ctx, num_batch, num_thread, num_gpu, main_gpu, use_mmap, keep_alive"
        );
        let err = message(flag(&options(&[("insecure", Value::from("yes"))]), "insecure").expect_err("string"));
        assert!(err.contains("option insecure must be a boolean (b), not s"), "{err}");
        assert!(flag(&options(&[("insecure", Value::Bool(true))]), "insecure").expect("bool"));
        assert!(!flag(&HashMap::new(), "insecure").expect("absent"));
    }

    #[test]
    fn unknown_keys_are_listed() {
        let err = message(
            only(&options(&[("zeta", Value::Bool(true)), ("alpha", Value::U8(1))]), &["insecure"])
                .expect_err("unknown"),
        );
        assert_eq!(err, "unknown option alpha, zeta; known: insecure");
        only(&options(&[("insecure", Value::Bool(true))]), &["insecure"]).expect("known");
    }
}
