//! `keep_alive`: how long a model stays loaded after its last request, as Ollama's
//! clients send it, and the server-side policy on top.
//!
//! From a request: a JSON number is seconds (fractions allowed), a string is a Go
//! duration (`"5m"`, `"1h30m"`, `"-1m"`), a negative value means forever, `0` unloads
//! when the request ends, `null` or absent keeps what the model already has (or the
//! default). A string without a unit other than `"0"` is an error, as in Ollama.
//! Beyond Ollama, the configuration can clamp what clients ask for.

use std::time::Duration;

use serde_json::Value;

/// How long a model stays loaded once idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KeepAlive {
    /// This long (zero: unload as soon as the last request ends).
    For(Duration),
    /// Until evicted or asked to unload.
    Forever,
}

/// A `keep_alive` value a client sent that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid keep_alive {value}: {reason}")]
pub struct InvalidKeepAlive {
    /// The value as sent.
    pub value: String,
    /// Why it is refused.
    pub reason: &'static str,
}

impl KeepAlive {
    /// Reads a request's `keep_alive`; `Ok(None)` when it is absent or null.
    pub fn from_json(value: Option<&Value>) -> Result<Option<Self>, InvalidKeepAlive> {
        let invalid = |reason| InvalidKeepAlive { value: value.map(Value::to_string).unwrap_or_default(), reason };
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => {
                let seconds = n.as_f64().ok_or_else(|| invalid("not a number"))?;
                Ok(Some(Self::from_seconds(seconds).ok_or_else(|| invalid("too large"))?))
            }
            Some(Value::String(s)) => {
                let nanos = parse_go_duration(s).map_err(invalid)?;
                Ok(Some(if nanos < 0 { Self::Forever } else { Self::For(Duration::from_nanos(nanos.unsigned_abs())) }))
            }
            Some(_) => Err(invalid("expected a duration string like \"5m\" or a number of seconds")),
        }
    }

    fn from_seconds(seconds: f64) -> Option<Self> {
        if seconds < 0.0 {
            return Some(Self::Forever);
        }
        Duration::try_from_secs_f64(seconds).ok().map(Self::For)
    }

    /// True for a zero duration: unload when the request ends.
    #[must_use]
    pub fn is_zero(self) -> bool {
        self == Self::For(Duration::ZERO)
    }

    /// The value as Ollama encodes it in responses: a Go duration, or `-1` for forever.
    #[must_use]
    pub fn to_json(self) -> Value {
        match self {
            Self::Forever => Value::from(-1),
            Self::For(d) => Value::from(humantime::format_duration(d).to_string().replace(' ', "")),
        }
    }
}

/// Server-side bounds on what clients may ask for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clamp {
    /// No shorter than this (a request for 0 still unloads: that is an explicit unload).
    pub min: Option<Duration>,
    /// No longer than this (forever becomes this).
    pub max: Option<Duration>,
}

/// The keep-alive a runner gets after a request: the request's (clamped), else the
/// runner's current one, else the default.
#[must_use]
pub fn resolve(
    requested: Option<KeepAlive>,
    current: Option<KeepAlive>,
    default: KeepAlive,
    clamp: Clamp,
) -> KeepAlive {
    let Some(requested) = requested else { return current.unwrap_or(default) };
    if requested.is_zero() {
        return requested;
    }
    let mut value = requested;
    if let Some(max) = clamp.max {
        value = value.min(KeepAlive::For(max));
    }
    if let Some(min) = clamp.min {
        value = value.max(KeepAlive::For(min));
    }
    value
}

/// Parses a Go duration (`"1h30m"`, `"1.5h"`, `"300ms"`, `"-1m"`, `"0"`) into signed
/// nanoseconds. Go's own rules: a unit on every number, except a bare `0`.
fn parse_go_duration(s: &str) -> Result<i64, &'static str> {
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err("empty duration");
    }
    let mut total: f64 = 0.0;
    while !rest.is_empty() {
        let number_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if number_len == 0 {
            return Err("expected a number");
        }
        let number: f64 = rest[..number_len].parse().map_err(|_| "bad number")?;
        rest = &rest[number_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let nanos_per_unit = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => return Err("missing unit (use \"5m\", \"300s\", … or a number of seconds)"),
            _ => return Err("unknown unit (use ns, us, ms, s, m or h)"),
        };
        total += number * nanos_per_unit;
        rest = &rest[unit_len..];
    }
    // Go's durations are i64 nanoseconds (about 292 years).
    if total > 9.2e18 {
        return Err("too large");
    }
    #[allow(clippy::cast_possible_truncation, reason = "bounded just above")]
    let nanos = total as i64;
    Ok(if negative { -nanos } else { nanos })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::{Clamp, KeepAlive, resolve};

    fn parse(v: &serde_json::Value) -> Result<Option<KeepAlive>, String> {
        KeepAlive::from_json(Some(v)).map_err(|e| e.to_string())
    }

    const fn secs(s: u64) -> KeepAlive {
        KeepAlive::For(Duration::from_secs(s))
    }

    #[test]
    fn what_clients_send() {
        let cases = [
            (json!("5m"), Ok(Some(secs(300)))),
            (json!("1h30m"), Ok(Some(secs(5400)))),
            (json!("1.5h"), Ok(Some(secs(5400)))),
            (json!("300ms"), Ok(Some(KeepAlive::For(Duration::from_millis(300))))),
            (json!("0"), Ok(Some(secs(0)))),
            (json!("0s"), Ok(Some(secs(0)))),
            (json!("-1m"), Ok(Some(KeepAlive::Forever))),
            (json!(-1), Ok(Some(KeepAlive::Forever))),
            (json!(600), Ok(Some(secs(600)))),
            (json!(42.5), Ok(Some(KeepAlive::For(Duration::from_millis(42_500))))),
            (json!(0), Ok(Some(secs(0)))),
            (json!(null), Ok(None)),
        ];
        for (input, expected) in cases {
            assert_eq!(parse(&input), expected, "{input}");
        }
        assert_eq!(KeepAlive::from_json(None), Ok(None));
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        for (input, reason) in [
            (json!("300"), "missing unit"),
            (json!("-1"), "missing unit"),
            (json!("5 minutes"), "unknown unit"),
            (json!("m"), "expected a number"),
            (json!(""), "empty duration"),
            (json!("1.2.3s"), "bad number"),
            (json!("999999999h"), "too large"),
            (json!(true), "expected a duration string"),
            (json!({"m": 5}), "expected a duration string"),
            (json!(1e300), "too large"),
        ] {
            let err = parse(&input).expect_err(&input.to_string());
            assert!(err.contains(reason) && err.starts_with("invalid keep_alive"), "{input}: {err}");
        }
    }

    #[test]
    fn resolution_and_clamps() {
        let default = secs(300);
        let none = Clamp::default();
        assert_eq!(resolve(None, None, default, none), default, "the default");
        assert_eq!(resolve(None, Some(secs(60)), default, none), secs(60), "unset keeps the runner's");
        assert_eq!(resolve(Some(secs(10)), Some(secs(60)), default, none), secs(10));
        let clamp = Clamp { min: Some(Duration::from_secs(30)), max: Some(Duration::from_secs(3600)) };
        assert_eq!(resolve(Some(KeepAlive::Forever), None, default, clamp), secs(3600));
        assert_eq!(resolve(Some(secs(5)), None, default, clamp), secs(30));
        assert_eq!(resolve(Some(secs(0)), None, default, clamp), secs(0), "an explicit unload stays one");
        assert_eq!(resolve(Some(secs(600)), None, default, clamp), secs(600));
    }

    #[test]
    fn encoded_like_ollama() {
        assert_eq!(KeepAlive::Forever.to_json(), json!(-1));
        assert_eq!(secs(300).to_json(), json!("5m"));
        assert_eq!(secs(5400).to_json(), json!("1h30m"));
    }
}
