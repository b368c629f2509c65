//! `keep_alive`: how long a model stays loaded after its last request, as Ollama's
//! clients send it, and the server-side policy on top.
//!
//! From a request: a JSON number is seconds (fractions allowed), a string is a Go
//! duration (`"5m"`, `"1h30m"`, `"-1m"`), a negative value means forever, `0` unloads
//! when the request ends, `null` or absent keeps what the model already has (or the
//! default). A string without a unit other than `"0"` is an error, as in Ollama. A number
//! of seconds longer than Go's longest duration (about 292 years) means forever, as in
//! Ollama on x86-64 (its conversion overflows to a negative duration); a string that long
//! is an error, as in Go.
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
                Ok(Some(Self::from_seconds(seconds)))
            }
            Some(Value::String(s)) => {
                let nanos = parse_go_duration(s).map_err(invalid)?;
                Ok(Some(if nanos < 0 { Self::Forever } else { Self::For(Duration::from_nanos(nanos.unsigned_abs())) }))
            }
            Some(_) => Err(invalid("expected a duration string like \"5m\" or a number of seconds")),
        }
    }

    fn from_seconds(seconds: f64) -> Self {
        match Duration::try_from_secs_f64(seconds) {
            Ok(d) if d <= crate::durations::LONGEST => Self::For(d),
            // Negative, or past the longest (JSON has no NaN).
            _ => Self::Forever,
        }
    }

    /// True for a zero duration: unload when the request ends.
    #[must_use]
    pub fn is_zero(self) -> bool {
        self == Self::For(Duration::ZERO)
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
/// nanoseconds. Go's own rules: a unit on every number, except a bare `0`; integer
/// arithmetic (exact to the nanosecond), fractions truncated.
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
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let (whole, after) = rest.split_at(digits(rest));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(digits(after)),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err("expected a number");
        }
        if after.starts_with('.') {
            return Err("bad number");
        }
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let nanos_per_unit: u64 = match &after[..unit_len] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err("missing unit (use \"5m\", \"300s\", … or a number of seconds)"),
            _ => return Err("unknown unit (use ns, us, ms, s, m or h)"),
        };
        let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| "too large")? };
        // Digits past the 18th are below a nanosecond of any unit.
        let (mut numerator, mut scale) = (0u128, 1u128);
        for digit in fraction.bytes().take(18) {
            numerator = numerator * 10 + u128::from(digit - b'0');
            scale *= 10;
        }
        let part = u128::from(whole) * u128::from(nanos_per_unit) + numerator * u128::from(nanos_per_unit) / scale;
        total = u64::try_from(part).ok().and_then(|part| total.checked_add(part)).ok_or("too large")?;
        rest = &after[unit_len..];
    }
    // Go's durations are i64 nanoseconds (about 292 years).
    let nanos = i64::try_from(total).map_err(|_| "too large")?;
    Ok(if negative { -nanos } else { nanos })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::{prop_assert_eq, proptest};
    use serde_json::{Value, json};

    use super::{Clamp, KeepAlive, parse_go_duration, resolve};

    fn parse(v: &Value) -> Result<Option<KeepAlive>, String> {
        KeepAlive::from_json(Some(v)).map_err(|e| e.to_string())
    }

    const fn secs(s: u64) -> KeepAlive {
        KeepAlive::For(Duration::from_secs(s))
    }

    /// A duration as Go writes it, less the zero units (`"1h30m"`, `"24h"`, `"1.5s"` is
    /// `"1s500ms"`): the strings [`parse_go_duration`] must read back to the nanosecond.
    fn format_go_duration(d: Duration) -> String {
        use std::fmt::Write as _;
        if d.is_zero() {
            return "0s".to_owned();
        }
        let (seconds, nanos) = (d.as_secs(), d.subsec_nanos());
        let parts = [
            (seconds / 3600, "h"),
            (seconds / 60 % 60, "m"),
            (seconds % 60, "s"),
            (u64::from(nanos / 1_000_000), "ms"),
            (u64::from(nanos / 1_000 % 1_000), "us"),
            (u64::from(nanos % 1_000), "ns"),
        ];
        let mut out = String::new();
        for (count, unit) in parts.into_iter().filter(|(count, _)| *count > 0) {
            let _ = write!(out, "{count}{unit}");
        }
        out
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
            // Past Go's longest duration (292 years): forever, as Ollama reads it.
            (json!(9_223_372_036_u64), Ok(Some(secs(9_223_372_036)))),
            (json!(9_223_372_037_u64), Ok(Some(KeepAlive::Forever))),
            (json!(u64::MAX), Ok(Some(KeepAlive::Forever))),
            (json!(1e300), Ok(Some(KeepAlive::Forever))),
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
    fn go_durations_are_exact_to_the_nanosecond() {
        // 3000h and 1ns: beyond f64's 53 bits of nanoseconds.
        assert_eq!(parse_go_duration("3000h1ns"), Ok(3000 * 3_600_000_000_000 + 1));
        assert_eq!(parse_go_duration("1.5h"), Ok(5_400_000_000_000));
        assert_eq!(parse_go_duration(".5s"), Ok(500_000_000));
        assert_eq!(parse_go_duration("1.s"), Ok(1_000_000_000));
        assert_eq!(parse_go_duration("0.1234567891ms"), Ok(123_456));
        assert_eq!(parse_go_duration("2562047h47m16.854775807s"), Ok(i64::MAX));
        assert_eq!(parse_go_duration("2562047h47m16.854775808s"), Err("too large"));
        assert_eq!(parse_go_duration("99999999999999999999h"), Err("too large"));
        assert_eq!(parse_go_duration(".s"), Err("expected a number"));
    }

    proptest! {
        /// Every duration Go can hold is written so that it reads back the same, as a
        /// request's `keep_alive` string.
        #[test]
        fn formatted_durations_parse_back(nanos in 0..=i64::MAX) {
            let d = Duration::from_nanos(nanos.unsigned_abs());
            let text = Value::from(format_go_duration(d));
            prop_assert_eq!(parse_go_duration(text.as_str().expect("a string")), Ok(nanos));
            prop_assert_eq!(KeepAlive::from_json(Some(&text)), Ok(Some(KeepAlive::For(d))));
            let negative = Value::String(format!("-{}", text.as_str().expect("a string")));
            let back = KeepAlive::from_json(Some(&negative)).expect("a negative duration");
            prop_assert_eq!(back, Some(if nanos == 0 { KeepAlive::For(Duration::ZERO) } else { KeepAlive::Forever }));
        }

        /// Go's forms with their units, summed exactly.
        #[test]
        fn unit_sums_parse_exactly(h in 0u64..100_000, m in 0u64..1000, s in 0u64..1000, ms in 0u64..1000, ns in 0u64..1000) {
            let text = format!("{h}h{m}m{s}s{ms}ms{ns}ns");
            let expected = (((h * 60 + m) * 60 + s) * 1000 + ms) * 1_000_000 + ns;
            prop_assert_eq!(parse_go_duration(&text), Ok(i64::try_from(expected).expect("in range")));
        }

        /// Any string is parsed or refused, never a panic; what parses is in Go's range.
        #[test]
        fn any_string_is_parsed_or_refused(text in "[-+]?[0-9.hmsuµn]{0,24}") {
            let _ = parse_go_duration(&text);
        }
    }
}
