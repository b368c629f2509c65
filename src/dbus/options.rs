//! D-Bus `a{sv}` options as the JSON values the HTTP API takes, so that both views parse
//! load options and keep-alive with the same code.

use std::collections::HashMap;

use serde_json::{Map, Number, Value as Json};
use zbus::zvariant::{OwnedValue, Value};

use super::error::Error;
use crate::scheduler::keep_alive::KeepAlive;

/// Load options (`num_ctx`, `num_gpu`, …) and the keep-alive from a Load call's options.
pub(super) fn load_options(
    options: &HashMap<String, OwnedValue>,
) -> Result<(Map<String, Json>, Option<KeepAlive>), Error> {
    let mut map = Map::new();
    for (key, value) in options {
        map.insert(key.clone(), json(key, value)?);
    }
    let keep_alive = KeepAlive::from_json(map.remove("keep_alive").as_ref())
        .map_err(|e| Error::InvalidArgument(format!("option keep_alive: {e}")))?;
    Ok((map, keep_alive))
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

fn json(key: &str, value: &Value<'_>) -> Result<Json, Error> {
    let number = |n: Option<Number>| {
        n.map(Json::Number).ok_or_else(|| Error::InvalidArgument(format!("option {key}: not a finite number")))
    };
    Ok(match value {
        Value::Bool(b) => Json::Bool(*b),
        Value::U8(n) => Json::from(*n),
        Value::I16(n) => Json::from(*n),
        Value::U16(n) => Json::from(*n),
        Value::I32(n) => Json::from(*n),
        Value::U32(n) => Json::from(*n),
        Value::I64(n) => Json::from(*n),
        Value::U64(n) => Json::from(*n),
        Value::F64(n) => number(Number::from_f64(*n))?,
        Value::Str(s) => Json::String(s.to_string()),
        // A variant inside the variant, as some clients send.
        Value::Value(inner) => json(key, inner)?,
        other => {
            return Err(Error::InvalidArgument(format!(
                "option {key} has type {}; expected a string, a number or a boolean",
                other.value_signature()
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use zbus::zvariant::{OwnedValue, Value};

    use super::{flag, load_options, only};
    use crate::dbus::error::Error;
    use crate::scheduler::keep_alive::KeepAlive;

    fn options(pairs: &[(&str, Value<'_>)]) -> HashMap<String, OwnedValue> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), v.try_to_owned().expect("owned"))).collect()
    }

    fn message(error: Error) -> String {
        match error {
            Error::InvalidArgument(m) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn numbers_strings_and_booleans_become_json_and_keep_alive_is_taken_out() {
        let given = options(&[
            ("num_ctx", Value::U32(4096)),
            ("num_gpu", Value::I32(-1)),
            ("use_mmap", Value::Bool(false)),
            ("keep_alive", Value::from("10m")),
        ]);
        let (map, keep_alive) = load_options(&given).expect("valid");
        assert_eq!(map["num_ctx"], 4096);
        assert_eq!(map["num_gpu"], -1);
        assert_eq!(map["use_mmap"], false);
        assert!(!map.contains_key("keep_alive"));
        assert_eq!(keep_alive, Some(KeepAlive::For(Duration::from_secs(600))));
        let (_, forever) = load_options(&options(&[("keep_alive", Value::I64(-1))])).expect("valid");
        assert_eq!(forever, Some(KeepAlive::Forever));
        let (_, none) = load_options(&HashMap::new()).expect("valid");
        assert_eq!(none, None);
    }

    #[test]
    fn wrong_types_are_named() {
        let err = message(load_options(&options(&[("num_ctx", Value::from(vec![1u32, 2]))])).expect_err("array"));
        assert!(err.contains("option num_ctx has type au"), "{err}");
        let err = message(load_options(&options(&[("keep_alive", Value::from("soon"))])).expect_err("bad"));
        assert!(err.contains("option keep_alive") && err.contains("soon"), "{err}");
        let err = message(load_options(&options(&[("x", Value::F64(f64::NAN))])).expect_err("nan"));
        assert!(err.contains("option x: not a finite number"), "{err}");
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
