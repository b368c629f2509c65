//! Durations written for people: `5.6 s`, `250 ms`, `5 min 30 s`, not `5.593436487s`.
//!
//! Every message that states a duration (errors, journal messages, client errors) goes
//! through [`human`]; structured fields keep their own machine form.

use std::fmt;
use std::time::Duration;

/// The longest duration anything from outside sets (a client's `keep_alive`, a key of the
/// configuration): Go's, and so Ollama's, largest, about 292 years. Clock arithmetic on it
/// stays far from overflow (an `Instant` or a `SystemTime` plus it, it in nanoseconds).
pub const LONGEST: Duration = Duration::from_nanos(i64::MAX.unsigned_abs());

/// `duration` rounded for reading; see the module.
#[must_use]
pub fn human(duration: Duration) -> Human {
    Human(duration)
}

/// A duration that displays for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Human(pub Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        let millis = d.as_millis();
        if d.is_zero() {
            return f.write_str("0 s");
        }
        if millis < 1000 {
            // Under a millisecond still says that something took time.
            return write!(f, "{} ms", millis.max(1));
        }
        if d < Duration::from_secs(10) {
            // One decimal, rounded; "5 s" rather than "5.0 s".
            let tenths = (millis + 50) / 100;
            return if tenths % 10 == 0 {
                write!(f, "{} s", tenths / 10)
            } else {
                write!(f, "{}.{} s", tenths / 10, tenths % 10)
            };
        }
        let secs = (millis + 500) / 1000;
        let (days, hours, mins, secs) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
        let parts = [(days, "d"), (hours, "h"), (mins, "min"), (secs, "s")];
        // The two largest units are enough for a person: "2 h 5 min", not "2 h 5 min 3 s".
        let first = parts.iter().position(|(n, _)| *n > 0).unwrap_or(3);
        let mut written = false;
        for (n, unit) in parts.iter().skip(first).take(2).filter(|(n, _)| *n > 0) {
            if written {
                f.write_str(" ")?;
            }
            write!(f, "{n} {unit}")?;
            written = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::human;

    #[test]
    fn durations_read_as_people_write_them() {
        let cases = [
            (Duration::ZERO, "0 s"),
            (Duration::from_nanos(300), "1 ms"),
            (Duration::from_millis(250), "250 ms"),
            (Duration::from_nanos(5_593_436_487), "5.6 s"),
            (Duration::from_millis(4_999), "5 s"),
            (Duration::from_secs(2), "2 s"),
            (Duration::from_millis(42_400), "42 s"),
            (Duration::from_secs(60), "1 min"),
            (Duration::from_secs(330), "5 min 30 s"),
            (Duration::from_secs(300), "5 min"),
            (Duration::from_secs(2 * 3600 + 5 * 60 + 3), "2 h 5 min"),
            (Duration::from_secs(3600), "1 h"),
            (Duration::from_secs(86_400 + 60), "1 d"),
            (Duration::from_secs(2 * 86_400 + 3 * 3600), "2 d 3 h"),
        ];
        for (duration, text) in cases {
            assert_eq!(human(duration).to_string(), text, "{duration:?}");
        }
    }
}
