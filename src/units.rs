//! Numbers for people in messages: bytes in binary units ("1.2 GiB") and durations
//! ("5.6 s", "2 min 5 s"). Structured fields keep the raw numbers.

use std::time::Duration;

/// Bytes in binary units, "1.2 GiB" (plain "512 B" below a KiB).
#[must_use]
pub fn bytes(n: u64) -> String {
    bytesize::ByteSize::b(n).display().iec().to_string()
}

/// A duration rounded for reading: "850 ms", "5.6 s", "42 s", "2 min 5 s", "1 h 3 min".
#[must_use]
pub fn duration(d: Duration) -> String {
    let millis = d.as_millis();
    if millis < 1000 {
        return format!("{millis} ms");
    }
    let secs = d.as_secs();
    if secs < 10 {
        let tenths = (millis + 50) / 100;
        return if tenths % 10 == 0 {
            format!("{} s", tenths / 10)
        } else {
            format!("{}.{} s", tenths / 10, tenths % 10)
        };
    }
    match secs {
        0..60 => format!("{secs} s"),
        60..3600 if secs % 60 == 0 => format!("{} min", secs / 60),
        60..3600 => format!("{} min {} s", secs / 60, secs % 60),
        _ if secs % 3600 / 60 == 0 => format!("{} h", secs / 3600),
        _ => format!("{} h {} min", secs / 3600, secs % 3600 / 60),
    }
}

/// `n` and a noun, with the noun's plural unless `n` is 1: "1 model", "2 models".
#[must_use]
pub fn count(n: usize, singular: &str, plural: &str) -> String {
    format!("{n} {}", if n == 1 { singular } else { plural })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{bytes, count, duration};

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1_288_490_189), "1.2 GiB");
        assert_eq!(duration(Duration::from_millis(850)), "850 ms");
        assert_eq!(duration(Duration::from_millis(5_593)), "5.6 s");
        assert_eq!(duration(Duration::from_secs(4)), "4 s");
        assert_eq!(duration(Duration::from_secs(42)), "42 s");
        assert_eq!(duration(Duration::from_secs(125)), "2 min 5 s");
        assert_eq!(duration(Duration::from_secs(300)), "5 min");
        assert_eq!(duration(Duration::from_secs(3780)), "1 h 3 min");
        assert_eq!(count(1, "model", "models"), "1 model");
        assert_eq!(count(0, "model", "models"), "0 models");
    }
}
