//! What bounds a render while it runs: the output writer, and gtmpl's string-building
//! builtins wrapped so that none builds a string past [`MAX_VALUE`] that is larger than
//! its largest argument (so chains of them cannot double a value again and again).

use std::fmt;
use std::io::{self, Write};
use std::time::Instant;

use gtmpl::{FuncError, Value};

use super::MAX_VALUE;

/// Why the writer stopped a render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// The output limit.
    Output,
    /// The deadline.
    Deadline,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Output => "output limit reached",
            Self::Deadline => "deadline passed",
        })
    }
}

impl std::error::Error for Stop {}

/// A builtin's result over [`MAX_VALUE`] (carried through gtmpl's `FuncError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TooLarge;

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a built string is too large")
    }
}

impl std::error::Error for TooLarge {}

/// The render's output: fails past `limit` bytes or after `deadline`, which stops
/// gtmpl at that write.
pub(super) struct Capped {
    out: Vec<u8>,
    limit: usize,
    deadline: Instant,
}

impl Capped {
    pub(super) fn new(limit: usize, deadline: Instant) -> Self {
        Self { out: Vec::new(), limit, deadline }
    }

    pub(super) fn into_inner(self) -> Vec<u8> {
        self.out
    }
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.out.len().saturating_add(buf.len()) > self.limit {
            return Err(io::Error::other(Stop::Output));
        }
        if Instant::now() > self.deadline {
            return Err(io::Error::other(Stop::Deadline));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Replaces the builtins that build strings with bounded ones.
pub(super) fn bound(template: &mut gtmpl::Template) {
    template.add_func("print", print);
    template.add_func("println", println);
    template.add_func("printf", printf);
    template.add_func("urlquery", urlquery);
}

/// The largest a result may be: [`MAX_VALUE`], or its largest argument.
fn cap(args: &[Value]) -> usize {
    args.iter().map(display_len).max().unwrap_or(0).max(MAX_VALUE)
}

fn too_large() -> FuncError {
    // gtmpl's function errors carry other errors as `anyhow`; the render takes this one
    // back out by its type.
    FuncError::Other(anyhow::Error::new(TooLarge))
}

/// Refuses a result over `cap`.
fn checked(result: Result<Value, FuncError>, cap: usize) -> Result<Value, FuncError> {
    match result? {
        Value::String(s) if s.len() > cap => Err(too_large()),
        value => Ok(value),
    }
}

fn print(args: &[Value]) -> Result<Value, FuncError> {
    // Exact but for the spaces gtmpl may put between operands.
    let size: usize = args.iter().map(|a| display_len(a) + 1).sum();
    if size > cap(args) + args.len() {
        return Err(too_large());
    }
    checked(gtmpl::funcs::print(args), cap(args))
}

fn println(args: &[Value]) -> Result<Value, FuncError> {
    let size: usize = args.iter().map(|a| display_len(a) + 1).sum();
    if size > cap(args) + args.len() + 1 {
        return Err(too_large());
    }
    checked(gtmpl::funcs::println(args), cap(args))
}

fn urlquery(args: &[Value]) -> Result<Value, FuncError> {
    // Percent-encoding at most triples the text: a transient of 3 caps at most.
    checked(gtmpl::funcs::urlquery(args), cap(args))
}

/// `printf`, with widths and precisions (which Rust's formatting refuses past 65 535
/// with a panic) and repeated verbs counted before anything is formatted.
fn printf(args: &[Value]) -> Result<Value, FuncError> {
    let cap = cap(args);
    if let Some(Value::String(format)) = args.first() {
        let largest = args[1..].iter().map(display_len).max().unwrap_or(0);
        let stars = args[1..].iter().filter_map(gtmpl::from_value::<i64>).map(i64::unsigned_abs).max();
        let estimate = printf_estimate(format, largest, stars.unwrap_or(0))?;
        // Formatting needs the result and its parts at once: four caps at most.
        if estimate > cap.saturating_mul(4) {
            return Err(too_large());
        }
    }
    checked(gtmpl::funcs::printf(args), cap)
}

/// An upper bound on `printf`'s result for `format` with arguments of at most
/// `largest` bytes shown, `star` the largest integer a `*` may take; a width or
/// precision of [`MAX_VALUE`] or more is refused.
fn printf_estimate(format: &str, largest: usize, star: u64) -> Result<usize, FuncError> {
    let bytes = format.as_bytes();
    let mut total = format.len();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            i += 1;
            continue;
        }
        i += 1;
        if bytes.get(i) == Some(&b'%') {
            i += 1;
            continue;
        }
        // Flags, argument indexes, width and precision up to the verb (a letter).
        let mut padding: u64 = 0;
        while i < bytes.len() && !bytes[i].is_ascii_alphabetic() && bytes[i] != b'%' {
            if bytes[i].is_ascii_digit() {
                let start = i;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                let number = format[start..i].parse::<u64>().unwrap_or(u64::MAX);
                padding = padding.saturating_add(number);
                continue;
            }
            if bytes[i] == b'*' {
                padding = padding.saturating_add(star);
            }
            i += 1;
        }
        if padding >= MAX_VALUE as u64 {
            return Err(too_large());
        }
        // `%q` escapes each byte into at most 10 (`\U0001f600` for 4), `%x` into 2;
        // a number shows in at most 330 bytes (f64::MAX in full).
        let factor = match bytes.get(i) {
            Some(b'q') => 10,
            Some(b'x' | b'X') => 2,
            _ => 1,
        };
        i += 1;
        let shown = largest.saturating_mul(factor).max(330);
        total = total.saturating_add(shown).saturating_add(usize::try_from(padding).unwrap_or(usize::MAX));
    }
    Ok(total)
}

/// An upper bound on the bytes gtmpl shows for `value`: collections print with Rust's
/// `Debug`, which escapes strings.
pub(super) fn display_len(value: &Value) -> usize {
    let mut total = 0usize;
    let mut stack = vec![(value, false)];
    while let Some((value, quoted)) = stack.pop() {
        total = total.saturating_add(match value {
            Value::String(s) if quoted => debug_len(s),
            Value::String(s) => s.len(),
            Value::Array(items) => {
                stack.extend(items.iter().map(|v| (v, true)));
                2 + 2 * items.len()
            }
            Value::Object(map) | Value::Map(map) => {
                stack.extend(map.values().map(|v| (v, true)));
                map.keys().map(|k| debug_len(k) + 4).sum::<usize>() + 2
            }
            // `f64::MAX` shows all its 309 digits.
            Value::Number(_) => 330,
            Value::NoValue | Value::Nil | Value::Bool(_) | Value::Function(_) => 16,
        });
    }
    total
}

/// An upper bound on a string's `Debug` form: quotes, and at most 10 bytes per byte
/// escaped (`\u{10ffff}`).
fn debug_len(s: &str) -> usize {
    s.len().saturating_mul(10).saturating_add(2)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use gtmpl::Value;

    use super::{MAX_VALUE, display_len, printf_estimate};

    #[test]
    fn estimates_are_upper_bounds() {
        let cases = [
            ("%s|%v", Value::from("hé")),
            ("%q", Value::from("\u{1f600}\n")),
            ("%x", Value::from("abc")),
            ("%10.3f|%.1f", Value::from(1.5)),
            ("%-5d%%|%[1]d", Value::from(12)),
        ];
        for (format, arg) in cases {
            let args = [Value::from(format), arg.clone(), arg];
            let shown = gtmpl::funcs::printf(&args).expect("formats").to_string();
            let largest = args[1..].iter().map(display_len).max().unwrap_or(0);
            assert!(shown.len() <= printf_estimate(format, largest, 0).expect("bounded"), "{format}");
        }
        let map: std::collections::HashMap<String, Value> = [("k\"".to_owned(), Value::from("v\n"))].into();
        let value = Value::from(map);
        assert!(value.to_string().len() <= display_len(&value));
    }

    #[test]
    fn a_width_past_the_value_limit_is_refused_before_formatting() {
        assert!(printf_estimate("%65536d", 1, 0).is_err());
        assert!(printf_estimate("%.99999999999999999999999f", 1, 0).is_err());
        assert!(printf_estimate("%*d", 1, MAX_VALUE as u64).is_err());
        assert!(printf_estimate("%5d%%", 1, 0).is_ok());
    }

    #[test]
    fn the_writer_stops_at_its_limit_and_its_deadline() {
        use std::io::Write;
        let mut out = super::Capped::new(4, Instant::now() + Duration::from_secs(60));
        out.write_all(b"abcd").expect("fits");
        let error = out.write_all(b"e").expect_err("over");
        assert_eq!(error.get_ref().and_then(|e| e.downcast_ref::<super::Stop>()), Some(&super::Stop::Output));
        let mut late = super::Capped::new(4, Instant::now().checked_sub(Duration::from_secs(1)).expect("past"));
        let error = late.write_all(b"a").expect_err("late");
        assert_eq!(error.get_ref().and_then(|e| e.downcast_ref::<super::Stop>()), Some(&super::Stop::Deadline));
    }
}
